// chatlane web chat: one WebSocket, JSON events; Markdown is rendered by markdown.js.
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
  const activity = $("activity");
  const activityLabel = $("activity-label");
  const activityElapsed = $("activity-elapsed");
  const activityWaiting = $("activity-waiting");
  const menu = $("menu");
  const sidebar = $("sidebar");
  const backdrop = $("backdrop");
  const narrow = window.matchMedia("(max-width: 720px)");

  const state = {
    socket: null,
    retry: 500,
    leaving: false,
    commands: [],
    matches: [],
    selected: -1,
    streams: new Map(), // turn id -> {node, text, frame}: the reply being streamed
    approvals: new Map(), // turn id -> that turn's approval cards
    nextRef: 1,
    refs: new Map(), // ref -> this tab's message bubble, until the server names its id
    said: new Map(), // message id -> its bubble
    tracked: new Map(), // message id -> {state, shortId}: not ended yet
    ended: new Set(), // message ids whose outcome came
    cancelled: new Set(), // message ids this tab asked to take out of the queue
    since: 0, // performance.now() when the running turn (or the wait) began
    ticker: 0,
  };

  const SPEAKERS = { user: "You: ", assistant: "Assistant: ", command: "Command answer: " };
  const STATE_TEXT = {
    running: "Running",
    queued: "Queued",
    merged: "Merged into the next turn",
    steered: "Steered into the running turn",
    interrupting: "Interrupting the running turn",
    redirecting: "Redirecting the running turn",
    refused: "Refused — not run",
    command: "",
  };
  const OUTCOME_TEXT = {
    answered: "",
    refused: "Refused — not run",
    dropped: "Dropped — not run",
    interrupted: "Interrupted",
    stopped: "Stopped",
    failed: "Failed",
    "shut down": "Waits for the server to come back",
  };
  const WAITING = new Set(["queued", "merged", "interrupting", "redirecting"]);
  // what /unqueue can still take back: a waiting message, or a steer the agent has not taken
  const CANCELLABLE = new Set([...WAITING, "steered"]);
  const APPROVAL_HINT =
    "Approve allows it once; reply /approve session or /approve always to allow it again.";
  const raw = new WeakMap(); // bubble -> the text it shows

  // -- rendering -------------------------------------------------------------

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function nearBottom(margin) {
    return log.scrollHeight - log.scrollTop - log.clientHeight < margin;
  }

  function append(node) {
    const stick = nearBottom(80);
    empty.hidden = true;
    log.append(node);
    if (stick) log.scrollTop = log.scrollHeight;
    return node;
  }

  function bubble(role, text, id) {
    const node = element("div", `msg ${role}`);
    if (role === "user" && text.startsWith("/")) node.classList.add("slash");
    node.append(element("span", "visually-hidden", SPEAKERS[role]));
    node.append(element("div", "text"));
    fill(node, text);
    if (id) {
      node.dataset.id = id;
      if (role === "user") state.said.set(id, node);
    }
    return append(node);
  }

  /** An assistant's text is Markdown; everything else is shown as typed. */
  function fill(node, text) {
    const body = node.querySelector(".text");
    raw.set(node, text);
    if (node.classList.contains("assistant")) body.replaceChildren(chatlaneMarkdown.render(text));
    else body.textContent = text;
  }

  function systemLine(kind, text) {
    return append(element("p", `system ${kind}`, text));
  }

  /**
   * What an approval asks: its command verbatim, as text in a code block (never
   * Markdown, which could hide part of it), with its reason; the prompt's own text
   * when the event names no request.
   */
  function approvalQuestion(text, asks) {
    if (!asks) return [element("p", "approval-text", text)];
    const command = element("pre", "approval-command");
    command.append(element("code", "", asks.command));
    const parts = [element("p", "approval-text", "Approval needed to run:"), command];
    if (asks.reason) parts.push(element("p", "approval-reason", asks.reason));
    parts.push(element("p", "approval-hint", APPROVAL_HINT));
    return parts;
  }

  function approvalCard(id, text, request, asks) {
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
    card.append(...approvalQuestion(text, asks), actions);
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

  // -- replies, streamed or whole ------------------------------------------------

  function chunk(event) {
    let stream = state.streams.get(event.id);
    if (!stream) {
      const node = bubble("assistant", "");
      node.classList.add("streaming");
      node.setAttribute("aria-busy", "true");
      stream = { node, text: "", frame: 0 };
      state.streams.set(event.id, stream);
    }
    stream.text += event.text;
    if (!stream.frame) stream.frame = requestAnimationFrame(() => paint(stream));
  }

  function paint(stream) {
    stream.frame = 0;
    const stick = nearBottom(160);
    fill(stream.node, stream.text);
    if (stick) log.scrollTop = log.scrollHeight;
  }

  function reply(event) {
    const stream = state.streams.get(event.id);
    let node;
    if (stream) {
      state.streams.delete(event.id);
      cancelAnimationFrame(stream.frame);
      node = stream.node;
      node.classList.remove("streaming");
      node.removeAttribute("aria-busy");
      stream.text = event.text;
      paint(stream); // kept in view as its chunks were, even those no frame painted
    } else {
      node = bubble(event.command ? "command" : "assistant", event.text);
    }
    if (event.id) node.dataset.replyTo = event.id;
    for (const card of state.approvals.get(event.id) || []) settle(card, "Answered");
    state.approvals.delete(event.id);
  }

  /** A reply shown as an agent's turned out to answer a command (a "yes" or "no"). */
  function restyleAnswer(id) {
    const node = log.querySelector(`.msg.assistant[data-reply-to="${CSS.escape(id)}"]`);
    if (!node || node.classList.contains("streaming")) return;
    node.className = "msg command";
    node.querySelector(".visually-hidden").textContent = SPEAKERS.command;
    fill(node, raw.get(node) || "");
  }

  // -- what became of each message ------------------------------------------------

  function mark(id, kind, text, shortId) {
    const node = state.said.get(id);
    if (!node) return;
    node.dataset.state = kind;
    let badge = node.querySelector(".msg-state");
    if (!text) {
      if (badge) badge.remove();
      return;
    }
    if (!badge) badge = node.appendChild(element("div", "msg-state"));
    const label = shortId ? `${text} · #${shortId}` : text;
    badge.replaceChildren(element("span", "msg-state-text", label));
    if (shortId && CANCELLABLE.has(kind)) badge.append(cancelButton(id, shortId));
  }

  function cancelButton(id, shortId) {
    const button = element("button", "cancel", "Cancel");
    button.type = "button";
    button.setAttribute("aria-label", `Cancel queued message #${shortId}`);
    button.addEventListener("click", () => {
      if (!send(`/unqueue #${shortId}`, false)) return;
      state.cancelled.add(id);
      button.disabled = true;
    });
    return button;
  }

  function arrived(event) {
    if (state.ended.has(event.id)) return;
    const kind = event.state;
    if (kind === "command" || kind === "refused") {
      state.tracked.delete(event.id);
      if (kind === "command") restyleAnswer(event.id);
    } else {
      if (!state.tracked.size) state.since = performance.now();
      state.tracked.set(event.id, { state: kind, shortId: event.short_id || 0 });
      if (kind === "running") state.since = performance.now() - (event.elapsed || 0) * 1000;
    }
    mark(event.id, kind, STATE_TEXT[kind] ?? kind, event.short_id);
    showActivity();
  }

  function ended(event) {
    const entry = state.tracked.get(event.id);
    state.tracked.delete(event.id);
    state.ended.add(event.id);
    let text = OUTCOME_TEXT[event.outcome] ?? event.outcome;
    if (event.outcome === "dropped" && state.cancelled.has(event.id)) text = "Cancelled";
    mark(event.id, event.outcome, text);
    if (event.outcome !== "answered") {
      for (const card of state.approvals.get(event.id) || []) settle(card, "No longer asked");
    }
    if (entry && entry.state === "running") startNext();
    showActivity();
  }

  /** The running turn ended: the oldest waiting message runs next. */
  function startNext() {
    const entries = [...state.tracked.entries()];
    if (entries.some(([, t]) => t.state === "running")) return;
    state.since = performance.now();
    const waiting = entries.filter(([, t]) => WAITING.has(t.state));
    waiting.sort(([, a], [, b]) => (a.shortId || Infinity) - (b.shortId || Infinity));
    if (!waiting.length) return;
    const [id, next] = waiting[0];
    next.state = "running";
    mark(id, "running", STATE_TEXT.running);
  }

  function showActivity() {
    const busy = state.tracked.size > 0;
    activity.hidden = !busy;
    if (busy && !state.ticker) state.ticker = setInterval(tick, 1000);
    if (!busy && state.ticker) {
      clearInterval(state.ticker);
      state.ticker = 0;
    }
    if (busy) tick();
  }

  function tick() {
    const states = [...state.tracked.values()].map((t) => t.state);
    const running = states.filter((s) => s === "running" || s === "steered").length;
    const waiting = states.length - running;
    const label = running ? "Working" : "Waiting for a turn";
    if (activityLabel.textContent !== label) activityLabel.textContent = label;
    activityElapsed.textContent = elapsed((performance.now() - state.since) / 1000);
    activityWaiting.textContent = waiting ? `${waiting} waiting` : "";
  }

  function elapsed(seconds) {
    const whole = Math.max(0, Math.floor(seconds));
    if (whole < 60) return `${whole} s`;
    return `${Math.floor(whole / 60)} min ${String(whole % 60).padStart(2, "0")} s`;
  }

  function forgetMessages() {
    for (const stream of state.streams.values()) cancelAnimationFrame(stream.frame);
    state.streams.clear();
    state.approvals.clear();
    state.refs.clear();
    state.said.clear();
    state.tracked.clear();
    state.ended.clear();
    state.cancelled.clear();
    showActivity();
  }

  // -- history and the conversation list ---------------------------------------------

  function history(event) {
    forgetMessages();
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
    button.dataset.conversation = item.id;
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
      if (narrow.matches) toggleDrawer(false);
    });
    const li = element("li");
    li.append(button);
    return li;
  }

  function retitled(event) {
    const current = conversationList.querySelector('button[aria-current="true"]');
    if (!current || current.dataset.conversation !== event.conversation || !event.title) return;
    current.dataset.titled = "yes";
    current.querySelector(".conversation-title").textContent = event.title;
    heading.textContent = event.title;
  }

  function notePreview(text) {
    if (text.startsWith("/")) return;
    const current = conversationList.querySelector('button[aria-current="true"]');
    if (!current || current.dataset.titled) return;
    const label = text.split(/\s+/).join(" ").trim().slice(0, 80);
    current.querySelector(".conversation-title").textContent = label;
    heading.textContent = label;
  }

  // -- the drawer (narrow screens) ------------------------------------------------------

  function toggleDrawer(open) {
    document.body.classList.toggle("drawer-open", open);
    menu.setAttribute("aria-expanded", String(open));
    backdrop.hidden = !open;
    if (open) $("new-conversation").focus();
  }

  menu.addEventListener("click", () => toggleDrawer(menu.getAttribute("aria-expanded") !== "true"));
  backdrop.addEventListener("click", () => toggleDrawer(false));
  sidebar.addEventListener("keydown", (event) => {
    if (event.key !== "Escape" || !narrow.matches) return;
    toggleDrawer(false);
    menu.focus();
  });
  narrow.addEventListener("change", () => toggleDrawer(false));

  // -- the socket ----------------------------------------------------------------

  const handlers = {
    commands: (event) => { state.commands = event.items; },
    history,
    conversations,
    title: retitled,
    chunk,
    reply,
    accepted: (event) => {
      const node = state.refs.get(event.ref);
      state.refs.delete(event.ref);
      if (!node) return;
      node.dataset.id = event.id;
      state.said.set(event.id, node);
    },
    user: (event) => {
      bubble("user", event.text, event.id);
      notePreview(event.text);
    },
    state: arrived,
    outcome: ended,
    ack: (event) => systemLine("ack", event.text),
    notice: (event) => systemLine("notice", event.text),
    error: (event) => systemLine("error", event.text),
    approval: (event) => approvalCard(event.id, event.text, event.approval_id, event.asks),
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
    } else if (event.code === 4429) {
      setStatus("closed", "Too many wrong tokens from this address; try again in a minute");
      setTimeout(connect, blockedFor(event.reason));
    } else {
      setStatus("closed", "Disconnected — reconnecting…");
      setTimeout(connect, state.retry);
      state.retry = Math.min(state.retry * 2, 10000);
    }
  }

  /**
   * Milliseconds to wait after close code 4429 before connecting again: the seconds its
   * reason names ("too many wrong tokens: try again in 42 s"), else a minute; no token
   * of this address is judged before then, so an earlier try would be refused again.
   */
  function blockedFor(reason) {
    const named = /try again in (\d+) s/.exec(reason || "");
    const seconds = named ? Math.min(Number(named[1]), 60) : 60;
    return Math.max(seconds, 1) * 1000;
  }

  /** Send `text`; shown in the log as this tab's message when `echo`. */
  function send(text, echo = true) {
    const socket = state.socket;
    if (!socket || socket.readyState !== WebSocket.OPEN) {
      systemLine("error", "Not connected — the message was not sent.");
      return false;
    }
    const frame = { type: "message", text };
    if (echo) {
      frame.ref = `r${state.nextRef++}`;
      state.refs.set(frame.ref, bubble("user", text));
      notePreview(text);
    }
    socket.send(JSON.stringify(frame));
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
    const most = Number(input.dataset.maxBytes);
    if (size > most) {
      // the server counts bytes of UTF-8; no maxlength on the box, which would cut a paste
      // short without a word: refuse here, and keep the whole text
      systemLine("error", `Message too long (${size} bytes; at most ${most}).`);
      return;
    }
    if (send(text)) {
      input.value = "";
      resize();
      hideHelp();
    }
  });

  $("new-conversation").addEventListener("click", () => {
    send("/new confirm", false);
    if (narrow.matches) toggleDrawer(false);
  });
  $("stop").addEventListener("click", () => send("/stop", false));
  window.addEventListener("pagehide", () => {
    state.leaving = true;
  });

  input.focus();
  connect();
})();
