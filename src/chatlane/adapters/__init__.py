"""Platform adapters: each turns its platform's events into messages and delivers replies."""
