// chatlane web chat: one WebSocket, JSON events, no dependencies.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const log = $("log");
  const empty = $("empty");
  const input = $("input");
  const form = $("composer");
  const statusLine = $("status");
  const heading = $("chat-heading");
  const conversationList = $("conversations");
  const help = $("command-help");
  const commandList = $("command-list");

  const state = {
    socket: null,
    retry: 500,
    leaving: false,
    commands: [],
    matches: [],
    selected: -1,
    streams: new Map(), // turn id -> bubble being streamed
    approvals: new Map(), // turn id -> that turn's approval cards
  };

  // -- rendering -------------------------------------------------------------

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function append(node) {
    const stick = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
    empty.hidden = true;
    log.append(node);
    if (stick) log.scrollTop = log.scrollHeight;
    return node;
  }

  function bubble(role, text) {
    const node = element("div", `msg ${role}`);
    node.append(element("span", "visually-hidden", role === "user" ? "You: " : "Assistant: "));
    node.append(element("span", "text", text));
    return append(node);
  }

  function systemLine(kind, text) {
    return append(element("p", `system ${kind}`, text));
  }

  function approvalCard(id, text, request) {
    const card = element("div", "approval");
    card.setAttribute("role", "group");
    card.setAttribute("aria-label", "Approval request");
    const approve = element("button", "approve", "Approve");
    const deny = element("button", "deny", "Deny");
    const outcome = element("span", "approval-outcome");
    approve.type = deny.type = "button";
    // "#request" names this card's request: a stale card never answers another one
    const named = request ? ` #${request}` : "";
    // the server says whether the answer counted; the card only says it was sent
    approve.addEventListener("click", () => answer(card, `/approve${named}`, "Approve sent"));
    deny.addEventListener("click", () => answer(card, `/deny${named}`, "Deny sent"));
    const actions = element("div", "approval-actions");
    actions.append(approve, deny, outcome);
    card.append(element("p", "approval-text", text), actions);
    if (id) state.approvals.set(id, [...(state.approvals.get(id) || []), card]);
    // focus stays where the user is: a key typed into the message box must never
    // approve; answering takes a click, or Tab to the buttons (the log announces the card)
    append(card);
  }

  function answer(card, command, label) {
    if (send(command, false)) settle(card, label);
  }

  function settle(card, label) {
    for (const button of card.querySelectorAll("button")) button.disabled = true;
    const outcome = card.querySelector(".approval-outcome");
    if (!outcome.textContent) outcome.textContent = label;
  }

  function chunk(event) {
    let node = state.streams.get(event.id);
    if (!node) {
      node = bubble("assistant", "");
      node.classList.add("streaming");
      node.setAttribute("aria-busy", "true");
      state.streams.set(event.id, node);
    }
    node.querySelector(".text").textContent += event.text;
    if (log.scrollHeight - log.scrollTop - log.clientHeight < 160) log.scrollTop = log.scrollHeight;
  }

  function reply(event) {
    const node = state.streams.get(event.id);
    if (node) {
      state.streams.delete(event.id);
      node.querySelector(".text").textContent = event.text;
      node.classList.remove("streaming");
      node.removeAttribute("aria-busy");
    } else {
      bubble("assistant", event.text);
    }
    for (const card of state.approvals.get(event.id) || []) settle(card, "Answered");
    state.approvals.delete(event.id);
  }

  function history(event) {
    state.streams.clear();
    state.approvals.clear();
    log.replaceChildren(empty);
    empty.hidden = event.messages.length > 0;
    for (const message of event.messages) {
      if (message.role === "notice") systemLine("notice", message.text);
      else bubble(message.role, message.text);
    }
    log.scrollTop = log.scrollHeight;
  }

  function conversations(event) {
    conversationList.replaceChildren(...event.items.map(conversationItem));
    const current = event.items.find((item) => item.current);
    heading.textContent = current ? itemLabel(current) : "Chat";
  }

  function itemLabel(item) {
    return item.title || item.preview || "New conversation";
  }

  function conversationItem(item) {
    const button = element("button");
    button.type = "button";
    button.dataset.id = item.id;
    if (item.title) button.dataset.titled = "yes";
    const started = new Date(item.started_at * 1000).toLocaleString([], {
      dateStyle: "medium",
      timeStyle: "short",
    });
    button.append(element("span", "conversation-title", itemLabel(item)));
    button.append(element("span", "conversation-meta", item.current ? `${started} · current` : started));
    if (item.current) button.setAttribute("aria-current", "true");
    button.addEventListener("click", () => {
      if (!item.current) send(`/resume ${item.id}`, false);
    });
    const li = element("li");
    li.append(button);
    return li;
  }

  function notePreview(text) {
    if (text.startsWith("/")) return;
    const current = conversationList.querySelector('button[aria-current="true"]');
    if (!current || current.dataset.titled) return;
    const label = text.split(/\s+/).join(" ").trim().slice(0, 80);
    current.querySelector(".conversation-title").textContent = label;
    heading.textContent = label;
  }

  // -- the socket ----------------------------------------------------------------

  const handlers = {
    commands: (event) => { state.commands = event.items; },
    history,
    conversations,
    chunk,
    reply,
    user: (event) => {
      bubble("user", event.text);
      notePreview(event.text);
    },
    ack: (event) => systemLine("ack", event.text),
    notice: (event) => systemLine("notice", event.text),
    error: (event) => systemLine("error", event.text),
    approval: (event) => approvalCard(event.id, event.text, event.approval_id),
  };

  function setStatus(kind, text) {
    statusLine.dataset.state = kind;
    statusLine.textContent = text;
  }

  function connect() {
    setStatus("connecting", "Connecting…");
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws`);
    state.socket = socket;
    socket.addEventListener("open", () => {
      state.retry = 500;
      setStatus("open", "Connected");
    });
    socket.addEventListener("message", (message) => {
      let event;
      try {
        event = JSON.parse(message.data);
      } catch {
        return;
      }
      const handle = handlers[event.type];
      if (handle) handle(event);
    });
    socket.addEventListener("close", closed);
  }

  function closed(event) {
    state.socket = null;
    if (state.leaving) return;
    if (event.code === 4401) {
      setStatus("closed", "Access token required — reload the page to sign in");
    } else if (event.code === 4400 || event.code === 4403) {
      setStatus("closed", "This tab lost its session — reload the page");
    } else {
      setStatus("closed", "Disconnected — reconnecting…");
      setTimeout(connect, state.retry);
      state.retry = Math.min(state.retry * 2, 10000);
    }
  }

  function send(text, echo = true) {
    const socket = state.socket;
    if (!socket || socket.readyState !== WebSocket.OPEN) {
      systemLine("error", "Not connected — the message was not sent.");
      return false;
    }
    socket.send(JSON.stringify({ type: "message", text }));
    if (echo) {
      bubble("user", text);
      notePreview(text);
    }
    return true;
  }

  // -- the composer and its command help --------------------------------------------

  function resize() {
    input.style.height = "auto";
    input.style.height = `${Math.min(input.scrollHeight, 200)}px`;
  }

  function showHelp() {
    const value = input.value;
    const prefix = value.startsWith("/") && !/\s/.test(value) ? value.slice(1).toLowerCase() : null;
    state.matches = prefix === null ? [] : state.commands.filter((c) => c.name.startsWith(prefix));
    state.selected = -1;
    if (!state.matches.length) return hideHelp();
    commandList.replaceChildren(...state.matches.map(commandOption));
    help.hidden = false;
  }

  function commandOption(command, index) {
    const li = element("li");
    li.id = `command-${command.name}`;
    li.setAttribute("role", "option");
    li.setAttribute("aria-selected", "false");
    li.append(element("span", "command-usage", command.usage));
    li.append(element("span", "command-summary", command.summary));
    li.addEventListener("mousedown", (event) => {
      event.preventDefault();
      complete(index);
    });
    return li;
  }

  function hideHelp() {
    help.hidden = true;
    state.matches = [];
    state.selected = -1;
    input.removeAttribute("aria-activedescendant");
  }

  function select(step) {
    const count = state.matches.length;
    state.selected = (state.selected + step + count) % count;
    commandList.querySelectorAll("li").forEach((li, i) => {
      li.setAttribute("aria-selected", String(i === state.selected));
      if (i === state.selected) {
        input.setAttribute("aria-activedescendant", li.id);
        li.scrollIntoView({ block: "nearest" });
      }
    });
  }

  function complete(index) {
    const command = state.matches[index];
    if (!command) return;
    const takesArguments = command.usage.trim().includes(" ");
    input.value = `/${command.name}${takesArguments ? " " : ""}`;
    hideHelp();
    input.focus();
    resize();
  }

  input.addEventListener("input", () => {
    resize();
    showHelp();
  });

  input.addEventListener("keydown", (event) => {
    const helping = !help.hidden && state.matches.length > 0;
    if (helping && (event.key === "ArrowDown" || event.key === "ArrowUp")) {
      event.preventDefault();
      select(event.key === "ArrowDown" ? 1 : -1);
    } else if (helping && event.key === "Tab") {
      event.preventDefault();
      complete(Math.max(state.selected, 0));
    } else if (helping && event.key === "Escape") {
      hideHelp();
    } else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (helping && state.selected >= 0) complete(state.selected);
      else form.requestSubmit();
    }
  });

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value;
    if (!text.trim()) return;
    const size = new TextEncoder().encode(text).length;
    if (size > input.maxLength) {
      // the server counts bytes of UTF-8, the textarea counts characters: refuse here, keep the text
      systemLine("error", `Message too long (${size} bytes; at most ${input.maxLength}).`);
      return;
    }
    if (send(text)) {
      input.value = "";
      resize();
      hideHelp();
    }
  });

  $("new-conversation").addEventListener("click", () => send("/new confirm", false));
  window.addEventListener("pagehide", () => {
    state.leaving = true;
  });

  input.focus();
  connect();
})();
