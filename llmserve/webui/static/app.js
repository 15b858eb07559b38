// The llmserve playground. It uses only the public API (/v1/models, /v1/chat/completions, /metrics), so what it
// shows is what any client would get. Conversations and settings live in localStorage, the API key in
// sessionStorage (this tab only). Model text is only ever put into the page as text or through renderMarkdown,
// which builds DOM nodes and never parses HTML.
"use strict";

(function () {
  const $ = (selector) => document.querySelector(selector);
  const KEYS = { conversations: "llmserve.conversations", current: "llmserve.current", settings: "llmserve.settings",
                 apiKey: "llmserve.apiKey" };
  const PARAMS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "seed", "max_tokens"];
  const DEFAULT_SETTINGS = { model: "", system: "", params: {}, stop: "", json_schema: "", tools: "", tool_choice: "auto" };
  const NUMBER = /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/;

  const state = {
    conversations: load(localStorage, KEYS.conversations, []),
    currentId: localStorage.getItem(KEYS.current),
    settings: { ...DEFAULT_SETTINGS, ...load(localStorage, KEYS.settings, {}) },
    streaming: null,  // {controller, conversation, message, node} while an answer arrives
  };

  // ---- storage ---------------------------------------------------------------------------------
  function load(storage, key, fallback) {
    try {
      const raw = storage.getItem(key);
      return raw ? JSON.parse(raw) : fallback;
    } catch (_) {
      return fallback;
    }
  }

  function saveConversations() {
    try {
      localStorage.setItem(KEYS.conversations, JSON.stringify(state.conversations));
      if (state.currentId) localStorage.setItem(KEYS.current, state.currentId);
    } catch (e) {
      showComposerError("Could not save the conversation in this browser: " + e.message);
    }
  }

  function saveSettings() {
    localStorage.setItem(KEYS.settings, JSON.stringify(state.settings));
  }

  function current() {
    return state.conversations.find((c) => c.id === state.currentId) || null;
  }

  function newConversation() {
    const conversation = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 7),
                           title: "New chat", created: new Date().toISOString(), messages: [] };
    state.conversations.unshift(conversation);
    state.currentId = conversation.id;
    saveConversations();
    return conversation;
  }

  // ---- the API ---------------------------------------------------------------------------------
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEYS.apiKey);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  // The server's own words: OpenAI's {"error": {"message", "type", "param", "code"}}.
  async function readError(response) {
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON */ }
    const error = body && body.error ? body.error : {};
    return { status: response.status, message: error.message || `${response.status} ${response.statusText}`,
             param: error.param ?? null, code: error.code ?? null };
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      showComposerError("Cannot reach the server: " + e.message);
      return;
    }
    if (response.status === 401) {
      const error = await readError(response);
      if (await askForKey(error.message)) return loadModels();
      return;
    }
    if (!response.ok) {
      showComposerError((await readError(response)).message);
      return;
    }
    const models = (await response.json()).data || [];
    const select = $("#model");
    select.replaceChildren(...models.map((m) => new Option(m.parent ? `${m.id} (adapter of ${m.parent})` : m.id, m.id)));
    if (models.some((m) => m.id === state.settings.model)) select.value = state.settings.model;
    state.settings.model = select.value;
  }

  // ---- the API key dialog ------------------------------------------------------------------------
  function askForKey(reason) {
    const dialog = $("#api-key-dialog");
    $("#api-key-reason").textContent = reason || "The API key for this server. It is kept in this tab's session storage only.";
    $("#api-key-input").value = sessionStorage.getItem(KEYS.apiKey) || "";
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => {
        if (dialog.returnValue === "save") {
          const key = $("#api-key-input").value.trim();
          if (key) sessionStorage.setItem(KEYS.apiKey, key);
          else sessionStorage.removeItem(KEYS.apiKey);
          resolve(true);
        } else {
          resolve(false);
        }
      }, { once: true });
      if (!dialog.open) dialog.showModal();
      $("#api-key-input").focus();
    });
  }

  // ---- the request ---------------------------------------------------------------------------------
  class ClientError extends Error {}

  function chatRequest(conversation) {
    const s = state.settings;
    const messages = [];
    if (s.system.trim()) messages.push({ role: "system", content: s.system });
    for (const m of conversation.messages) {
      if (m.role === "user") messages.push({ role: "user", content: m.content });
      else if (!m.error && (m.content || m.tool_calls?.length)) {
        const turn = { role: "assistant", content: m.content || "" };
        if (m.tool_calls?.length) turn.tool_calls = m.tool_calls;
        messages.push(turn);
      }
    }
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (s.model) body.model = s.model;
    for (const name of PARAMS) {
      const raw = String(s.params[name] ?? "").trim();
      // numbers go as numbers, anything else as typed: the server says what is wrong with it
      if (raw !== "") body[name] = NUMBER.test(raw) ? Number(raw) : raw;
    }
    const stops = s.stop.split("\n").filter((line) => line !== "");
    if (stops.length) body.stop = stops;
    if (s.json_schema.trim()) {
      let schema;
      try { schema = JSON.parse(s.json_schema); } catch (e) { throw new ClientError("JSON schema box: not valid JSON (" + e.message + ")"); }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    }
    if (s.tools.trim()) {
      let tools;
      try { tools = JSON.parse(s.tools); } catch (e) { throw new ClientError("Tools box: not valid JSON (" + e.message + ")"); }
      body.tools = tools;
      body.tool_choice = s.tool_choice;
    }
    return body;
  }

  async function generate(conversation) {
    hideComposerError();
    let body;
    try {
      body = chatRequest(conversation);
    } catch (e) {
      if (e instanceof ClientError) { showComposerError(e.message); return; }
      throw e;
    }
    const message = { role: "assistant", content: "", reasoning: "", tool_calls: [], model: body.model || "",
                      stats: {}, pending: true };
    conversation.messages.push(message);
    saveConversations();
    renderConversation();
    const node = $("#messages").lastElementChild;
    const controller = new AbortController();
    state.streaming = { controller, conversation, message, node };
    setBusy(true);

    const started = performance.now();
    let firstAt = null, lastAt = null, deltas = 0;
    const onDelta = () => {
      lastAt = performance.now();
      if (firstAt === null) { firstAt = lastAt; message.stats.ttft_ms = firstAt - started; }
      deltas += 1;
      // live figures while the answer streams; the server's usage replaces the count at the end
      message.stats.completion_tokens_seen = deltas;
      if (deltas > 1) message.stats.tokens_per_s = (deltas - 1) / ((lastAt - firstAt) / 1000);
      scheduleRender();
    };
    const handle = (data) => {
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) { message.error = { message: event.error.message, param: event.error.param ?? null }; return; }
      if (event.usage) {
        message.stats.prompt_tokens = event.usage.prompt_tokens;
        message.stats.completion_tokens = event.usage.completion_tokens;
        message.stats.cached_tokens = event.usage.prompt_tokens_details?.cached_tokens ?? 0;
        if (typeof event.usage.cost === "number") message.stats.cost = event.usage.cost;
      }
      for (const choice of event.choices || []) {
        if (choice.index !== 0) continue;
        const delta = choice.delta || {};
        if (delta.content) { message.content += delta.content; onDelta(); }
        if (delta.reasoning_content) { message.reasoning += delta.reasoning_content; onDelta(); }
        for (const call of delta.tool_calls || []) {
          const slot = message.tool_calls[call.index] ||= { id: "", type: "function", function: { name: "", arguments: "" } };
          if (call.id) slot.id = call.id;
          if (call.function?.name) slot.function.name += call.function.name;
          if (call.function?.arguments) slot.function.arguments += call.function.arguments;
          onDelta();
        }
        if (choice.finish_reason) message.stats.finish_reason = choice.finish_reason;
      }
    };

    try {
      const response = await fetch("v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                              signal: controller.signal });
      if (!response.ok) {
        const error = await readError(response);
        message.error = error;
        if (response.status === 401) askForKey(error.message);
      } else {
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const event = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            for (const line of event.split("\n")) if (line.startsWith("data:")) handle(line.slice(5).trim());
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") message.stats.finish_reason = message.stats.finish_reason || "stopped";
      else message.error = { message: "The connection failed: " + e.message };
    } finally {
      if (message.stats.completion_tokens !== undefined) delete message.stats.completion_tokens_seen;
      const produced = message.stats.completion_tokens ?? deltas;
      if (firstAt !== null && lastAt > firstAt && produced > 1) message.stats.tokens_per_s = (produced - 1) / ((lastAt - firstAt) / 1000);
      if (!message.tool_calls.length) delete message.tool_calls;
      if (!message.reasoning) delete message.reasoning;
      delete message.pending;
      if (conversation.title === "New chat") conversation.title = titleFrom(conversation);
      state.streaming = null;
      setBusy(false);
      saveConversations();
      renderConversation();
      renderChatList();
    }
  }

  function titleFrom(conversation) {
    const first = conversation.messages.find((m) => m.role === "user");
    const text = first ? first.content.trim().replace(/\s+/g, " ") : "";
    return text ? (text.length > 48 ? text.slice(0, 47) + "…" : text) : "New chat";
  }

  function stop() {
    if (state.streaming) state.streaming.controller.abort();
  }

  // Returns whether the message went out; a settings box that is not valid JSON keeps it in the composer.
  function send(text) {
    if (state.streaming) return false;
    try {
      chatRequest({ messages: [] });
    } catch (e) {
      if (e instanceof ClientError) { showComposerError(e.message); return false; }
      throw e;
    }
    const conversation = current() || newConversation();
    conversation.messages.push({ role: "user", content: text });
    if (conversation.title === "New chat") conversation.title = titleFrom(conversation);
    generate(conversation);
    renderChatList();
    return true;
  }

  // ---- rendering -----------------------------------------------------------------------------------
  let renderQueued = false;
  function scheduleRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      const s = state.streaming;
      if (!s) return;
      const stick = nearBottom();
      s.node.replaceWith(s.node = messageNode(s.conversation, s.conversation.messages.indexOf(s.message)));
      if (stick) scrollToBottom();
    });
  }

  function nearBottom() {
    const box = $("#messages");
    return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  }

  function scrollToBottom() {
    const box = $("#messages");
    box.scrollTop = box.scrollHeight;
  }

  function button(label, onClick, attrs = {}) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    for (const [k, v] of Object.entries(attrs)) b.setAttribute(k, v);
    b.addEventListener("click", onClick);
    return b;
  }

  function span(text, cls) {
    const s = document.createElement("span");
    if (cls) s.className = cls;
    s.textContent = text;
    return s;
  }

  function statsNode(stats) {
    const parts = [];
    const add = (key, text) => { const s = span(text); s.dataset.stat = key; parts.push(s); };
    if (stats.ttft_ms !== undefined) add("ttft", `TTFT ${Math.round(stats.ttft_ms)} ms`);
    if (stats.tokens_per_s !== undefined) add("tps", `${stats.tokens_per_s.toFixed(1)} tok/s`);
    if (stats.prompt_tokens !== undefined) add("in", `in ${stats.prompt_tokens}`);
    if (stats.cached_tokens !== undefined) add("cached", `cached ${stats.cached_tokens}`);
    if (stats.completion_tokens !== undefined) add("out", `out ${stats.completion_tokens}`);
    else if (stats.completion_tokens_seen !== undefined) add("out", `out ≈${stats.completion_tokens_seen}`);
    if (stats.cost !== undefined) add("cost", `$${stats.cost.toPrecision(3)}`);
    if (stats.finish_reason) add("finish", `finish_reason ${stats.finish_reason}`);
    const box = document.createElement("div");
    box.className = "stats";
    box.append(...parts);
    return box;
  }

  function messageNode(conversation, index) {
    const m = conversation.messages[index];
    const li = document.createElement("li");
    li.className = "message " + m.role + (m.pending ? " pending" : "");
    li.dataset.index = index;
    const who = span(m.role === "user" ? "You" : (m.model || "Assistant"), "who");
    li.append(who);

    if (m.role === "user") {
      const content = document.createElement("div");
      content.className = "content plain";
      content.textContent = m.content;
      li.append(content);
      if (!state.streaming) {
        const actions = document.createElement("div");
        actions.className = "actions";
        actions.append(button("Edit", () => editTurn(conversation, index, li), { "aria-label": "Edit this message" }));
        li.append(actions);
      }
      return li;
    }

    if (m.reasoning) {
      const details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      details.append(summary);
      const body = document.createElement("div");
      body.className = "content plain";
      body.textContent = m.reasoning;
      details.append(body);
      li.append(details);
    }
    const content = document.createElement("div");
    content.className = "content markdown";
    content.append(window.renderMarkdown(m.content));
    if (m.pending && !m.content && !(m.tool_calls || []).length) content.append(span("…", "typing"));
    li.append(content);
    for (const call of m.tool_calls || []) {
      const box = document.createElement("div");
      box.className = "tool-call";
      box.append(span("tool call", "tag"), span(call.function.name, "tool-name"));
      const args = document.createElement("pre");
      args.textContent = prettyJSON(call.function.arguments);
      box.append(args);
      li.append(box);
    }
    if (m.error) {
      const error = document.createElement("div");
      error.className = "error";
      error.setAttribute("role", "alert");
      error.textContent = m.error.message;
      if (m.error.param) error.append(span(` (param: ${m.error.param})`, "param"));
      li.append(error);
    }
    li.append(statsNode(m.stats || {}));
    if (!state.streaming) {
      const actions = document.createElement("div");
      actions.className = "actions";
      actions.append(button("Regenerate", () => regenerate(conversation, index), { "aria-label": "Regenerate this answer" }));
      actions.append(button("Copy", () => navigator.clipboard?.writeText(m.content), { "aria-label": "Copy this answer" }));
      li.append(actions);
    }
    return li;
  }

  function prettyJSON(text) {
    try { return JSON.stringify(JSON.parse(text), null, 2); } catch (_) { return text; }
  }

  function renderConversation() {
    const conversation = current();
    const list = $("#messages");
    const items = conversation ? conversation.messages.map((_, i) => messageNode(conversation, i)) : [];
    list.replaceChildren(...items);
    $("#empty-hint").hidden = items.length > 0;
    scrollToBottom();
  }

  function renderChatList() {
    const list = $("#chat-list");
    list.replaceChildren(...state.conversations.map((c) => {
      const li = document.createElement("li");
      if (c.id === state.currentId) li.className = "current";
      const open = button(c.title, () => { if (state.streaming) return; state.currentId = c.id; saveConversations(); renderAll(); closeDrawers(); },
                          { "aria-current": c.id === state.currentId ? "true" : "false" });
      open.className = "chat-title";
      const remove = button("×", () => deleteConversation(c.id), { "aria-label": `Delete conversation: ${c.title}`, title: "Delete" });
      remove.className = "delete-chat";
      li.append(open, remove);
      return li;
    }));
  }

  function renderAll() {
    renderChatList();
    renderConversation();
  }

  function deleteConversation(id) {
    if (state.streaming && state.streaming.conversation.id === id) return;
    state.conversations = state.conversations.filter((c) => c.id !== id);
    if (state.currentId === id) state.currentId = state.conversations[0]?.id || null;
    if (!state.currentId) localStorage.removeItem(KEYS.current);
    saveConversations();
    renderAll();
  }

  function editTurn(conversation, index, li) {
    const m = conversation.messages[index];
    const editor = document.createElement("textarea");
    editor.value = m.content;
    editor.rows = Math.min(12, Math.max(2, m.content.split("\n").length));
    editor.setAttribute("aria-label", "Edit message");
    const save = () => {
      const text = editor.value.trim();
      if (!text || state.streaming) return;
      m.content = text;
      conversation.messages.splice(index + 1);  // the turns after an edited one no longer follow from it
      generate(conversation);
    };
    const actions = document.createElement("div");
    actions.className = "actions";
    actions.append(button("Save & send", save), button("Cancel", renderConversation));
    editor.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
      if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); renderConversation(); }
    });
    li.querySelector(".content").replaceWith(editor);
    li.querySelector(".actions").replaceWith(actions);
    editor.focus();
  }

  function regenerate(conversation, index) {
    if (state.streaming) return;
    conversation.messages.splice(index);
    generate(conversation);
  }

  function setBusy(busy) {
    $("#send").hidden = busy;
    $("#stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  function showComposerError(text) {
    const box = $("#composer-error");
    box.textContent = text;
    box.hidden = false;
  }

  function hideComposerError() {
    $("#composer-error").hidden = true;
  }

  // ---- settings --------------------------------------------------------------------------------------
  function fillSettingsForm() {
    const form = $("#settings-form");
    form.elements.system.value = state.settings.system;
    for (const name of PARAMS) form.elements[name].value = state.settings.params[name] ?? "";
    form.elements.stop.value = state.settings.stop;
    form.elements.json_schema.value = state.settings.json_schema;
    form.elements.tools.value = state.settings.tools;
    form.elements.tool_choice.value = state.settings.tool_choice;
  }

  function readSettingsForm() {
    const form = $("#settings-form");
    state.settings.system = form.elements.system.value;
    for (const name of PARAMS) state.settings.params[name] = form.elements[name].value;
    state.settings.stop = form.elements.stop.value;
    state.settings.json_schema = form.elements.json_schema.value;
    state.settings.tools = form.elements.tools.value;
    state.settings.tool_choice = form.elements.tool_choice.value;
    saveSettings();
  }

  // ---- the server panel: /metrics, polled -------------------------------------------------------------
  function parseMetrics(text) {
    const sums = new Map();
    for (const line of text.split("\n")) {
      const m = /^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/.exec(line);
      if (m) sums.set(m[1], (sums.get(m[1]) || 0) + Number(m[2]));
    }
    return sums;
  }

  async function pollMetrics() {
    try {
      const response = await fetch("metrics");
      if (!response.ok) return;
      const text = await response.text();
      const m = parseMetrics(text);
      const show = (key, value) => { $(`[data-metric="${key}"]`).textContent = value; };
      const get = (name) => m.get("llmserve:" + name);
      if (get("num_requests_running") !== undefined) show("running", String(get("num_requests_running")));
      if (get("num_requests_waiting") !== undefined) show("waiting", String(get("num_requests_waiting")));
      if (get("kv_cache_usage_perc") !== undefined) show("kv", (100 * get("kv_cache_usage_perc")).toFixed(0) + " %");
      const queries = get("prefix_cache_queries_total"), hits = get("prefix_cache_hits_total");
      if (queries !== undefined) show("prefix", queries > 0 ? (100 * (hits || 0) / queries).toFixed(0) + " %" : "–");
      // behind `llmserve gateway`: its backends instead of one engine
      const up = m.get("llmserve_gateway:backend_up");
      if (up !== undefined && get("num_requests_running") === undefined) {
        const backends = [...text.matchAll(/^llmserve_gateway:backend_up\{/gm)].length;
        for (const span of document.querySelectorAll("#server-panel > span")) span.hidden = !span.hasAttribute("data-gateway");
        show("backends", `${up}/${backends}`);
        show("inflight", String(m.get("llmserve_gateway:backend_outstanding") || 0));
      }
    } catch (_) { /* the server is away; the next poll tries again */ }
  }

  // ---- export --------------------------------------------------------------------------------------
  function exportConversation() {
    const conversation = current();
    if (!conversation) { showComposerError("Nothing to export yet."); return; }
    const data = { exported_at: new Date().toISOString(), title: conversation.title, created: conversation.created,
                   model: state.settings.model, system: state.settings.system, settings: state.settings,
                   messages: conversation.messages };
    const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = `llmserve-chat-${conversation.created.slice(0, 19).replace(/[:T]/g, "-")}.json`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  // ---- narrow screens: the side panels become drawers -------------------------------------------------
  function toggleDrawer(name) {
    const open = !document.body.classList.contains("show-" + name);
    closeDrawers();
    document.body.classList.toggle("show-" + name, open);
    $("#toggle-" + name).setAttribute("aria-expanded", String(open));
  }

  function closeDrawers() {
    for (const name of ["chats", "settings"]) {
      document.body.classList.remove("show-" + name);
      $("#toggle-" + name).setAttribute("aria-expanded", "false");
    }
  }

  // ---- start -----------------------------------------------------------------------------------------
  function start() {
    // an answer cut off by a reload is kept as it was, marked as interrupted
    for (const c of state.conversations) for (const m of c.messages) {
      if (m.pending) { delete m.pending; m.stats = { ...(m.stats || {}), finish_reason: m.stats?.finish_reason || "interrupted" }; }
    }
    if (!current()) state.currentId = state.conversations[0]?.id || null;
    fillSettingsForm();
    renderAll();

    $("#composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const prompt = $("#prompt");
      const text = prompt.value.trim();
      if (text && send(text)) prompt.value = "";
    });
    $("#prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("#composer").requestSubmit(); }
    });
    $("#stop").addEventListener("click", stop);
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && state.streaming) { e.preventDefault(); stop(); }
    });
    $("#settings-form").addEventListener("input", readSettingsForm);
    $("#settings-form").addEventListener("change", readSettingsForm);
    $("#reset-settings").addEventListener("click", () => {
      state.settings = { ...DEFAULT_SETTINGS, params: {}, model: state.settings.model };
      saveSettings();
      fillSettingsForm();
    });
    $("#model").addEventListener("change", (e) => { state.settings.model = e.target.value; saveSettings(); });
    $("#new-chat").addEventListener("click", () => {
      if (state.streaming) return;
      const empty = current();
      if (!(empty && empty.messages.length === 0)) newConversation();
      renderAll();
      closeDrawers();
      $("#prompt").focus();
    });
    $("#export-chat").addEventListener("click", exportConversation);
    $("#api-key-button").addEventListener("click", async () => { if (await askForKey()) loadModels(); });
    $("#toggle-chats").addEventListener("click", () => toggleDrawer("chats"));
    $("#toggle-settings").addEventListener("click", () => toggleDrawer("settings"));

    loadModels();
    pollMetrics();
    setInterval(pollMetrics, 2000);
    $("#prompt").focus();
  }

  start();
})();
