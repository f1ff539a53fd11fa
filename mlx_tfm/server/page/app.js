// The chat page of `mlx-tfm server`: talks to the server's OpenAI API (/v1/models, /v1/props,
// streamed /v1/chat/completions), keeps conversations and settings in localStorage.
"use strict";

const CONVERSATIONS_KEY = "mlx-tfm-chat.conversations";
const SETTINGS_KEY = "mlx-tfm-chat.settings";
// The settings inputs, by the name they are stored under.
const SETTING_INPUTS = { system: "system-prompt", temperature: "temperature", top_p: "top-p",
                         max_tokens: "max-tokens", api_key: "api-key" };

const $ = (id) => document.getElementById(id);

const state = {
  conversations: readStored(CONVERSATIONS_KEY, []),
  currentId: null,
  server: { model: null, context_length: null, max_kv_size: null, defaults: {} },
  controller: null,  // the AbortController of the answer streaming now (null: none)
};

function readStored(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function saveConversations() {
  localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(state.conversations));
}

// -- settings ---------------------------------------------------------------------------------

function settings() {
  const values = {};
  for (const [name, id] of Object.entries(SETTING_INPUTS)) values[name] = $(id).value;
  return values;
}

function restoreSettings() {
  const stored = readStored(SETTINGS_KEY, {});
  for (const [name, id] of Object.entries(SETTING_INPUTS)) {
    if (stored[name] !== undefined) $(id).value = stored[name];
    $(id).addEventListener("change", () => localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings())));
  }
}

// The server's defaults fill the sampler inputs the user has left empty.
function fillDefaults(defaults) {
  const inputs = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens" };
  for (const [name, id] of Object.entries(inputs)) {
    if ($(id).value === "" && defaults[name] !== undefined) $(id).value = defaults[name];
  }
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// -- the server ---------------------------------------------------------------------------------

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function getJson(path) {
  const response = await fetch(path, { headers: authHeaders() });
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

// The model's name and context length; retried while the model loads (503).
async function connect() {
  try {
    const models = await getJson("/v1/models");
    const props = await getJson("/v1/props");
    state.server = { ...props, model: models.data[0]?.id ?? props.model };
    $("model-name").textContent = state.server.model;
    fillDefaults(props.defaults ?? {});
    renderContextUse();
  } catch (error) {
    $("model-name").textContent = `not connected: ${error.message}`;
    setTimeout(connect, 1500);
  }
}

// -- conversations ------------------------------------------------------------------------------

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function newConversation() {
  const conversation = { id: `${Date.now()}-${Math.random().toString(36).slice(2, 8)}`, title: "",
                         messages: [], usage: null, updated: Date.now() };
  state.conversations.push(conversation);
  state.currentId = conversation.id;
  return conversation;
}

function openConversation(id) {
  if (state.controller) return;  // an answer is streaming into the open one
  state.currentId = id;
  renderAll();
}

function deleteConversation(id) {
  if (state.controller && id === state.currentId) return;
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (id === state.currentId) state.currentId = null;
  saveConversations();
  renderAll();
}

// -- rendering ----------------------------------------------------------------------------------

function renderConversationList() {
  const list = $("conversations");
  list.replaceChildren();
  const newestFirst = [...state.conversations].sort((a, b) => b.updated - a.updated);
  for (const conversation of newestFirst) {
    const item = document.createElement("li");
    item.classList.toggle("active", conversation.id === state.currentId);
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = conversation.title || "(empty)";
    open.addEventListener("click", () => openConversation(conversation.id));
    const remove = document.createElement("button");
    remove.className = "delete";
    remove.type = "button";
    remove.title = "delete this conversation";
    remove.textContent = "×";
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    list.append(item);
  }
}

const NOTES = { stopped: "stopped", length: "cut at max tokens" };

// One message's bubble content: the user's text as text, the model's answer as markdown.
function fillBubble(bubble, message) {
  bubble.className = `message ${message.error ? "error" : message.role}`;
  bubble.dataset.state = message.error ? "error" : message.state ?? "done";
  if (message.error) {
    bubble.textContent = message.error;
  } else if (message.role === "user") {
    bubble.textContent = message.content;
  } else {
    const note = NOTES[message.state] ? `<p class="note">(${NOTES[message.state]})</p>` : "";
    bubble.innerHTML = renderMarkdown(message.content) + note;
  }
}

function renderMessages() {
  const conversation = currentConversation();
  const box = $("messages");
  box.replaceChildren();
  for (const message of conversation?.messages ?? []) {
    const bubble = document.createElement("div");
    fillBubble(bubble, message);
    box.append(bubble);
  }
  box.scrollTop = box.scrollHeight;
}

function renderContextUse() {
  const used = currentConversation()?.usage?.total_tokens ?? 0;
  const { context_length: length, max_kv_size: kvWindow } = state.server;
  let text = `${used} tokens`;
  if (length) text = `${used} / ${length} tokens`;
  else if (kvWindow) text = `${used} tokens (rotating window of ${kvWindow})`;
  $("context-use").textContent = text;
}

function renderAll() {
  renderConversationList();
  renderMessages();
  renderContextUse();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// -- sending and streaming ----------------------------------------------------------------------

function numberOrUndefined(text) {
  return text.trim() === "" ? undefined : Number(text);
}

// The request body: the system prompt, then the conversation's finished turns.
function requestBody(conversation) {
  const chosen = settings();
  const turns = conversation.messages.filter((m) => !m.error && m.state !== "streaming");
  const messages = turns.map((m) => ({ role: m.role, content: m.content }));
  if (chosen.system.trim()) messages.unshift({ role: "system", content: chosen.system });
  return {
    model: state.server.model ?? undefined, messages, stream: true, stream_options: { include_usage: true },
    temperature: numberOrUndefined(chosen.temperature), top_p: numberOrUndefined(chosen.top_p),
    max_tokens: numberOrUndefined(chosen.max_tokens),
  };
}

// One server-sent event's data: a chunk adds to the answer; the last one carries the usage.
function takeEvent(data, conversation, answer) {
  if (data === "[DONE]") return;
  const chunk = JSON.parse(data);
  if (chunk.error) throw new Error(chunk.error.message ?? JSON.stringify(chunk.error));
  const choice = chunk.choices?.[0];
  if (choice?.delta?.content) answer.content += choice.delta.content;
  if (choice?.finish_reason) answer.finish = choice.finish_reason;
  if (chunk.usage) conversation.usage = chunk.usage;
}

// Stream the answer into ``answer`` (and its bubble), event by event.
async function streamAnswer(conversation, answer, bubble, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", signal, body: JSON.stringify(requestBody(conversation)),
    headers: { "Content-Type": "application/json", ...authHeaders() },
  });
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += value;
    const events = pending.split("\n\n");
    pending = events.pop();  // an event not yet complete waits for the next read
    for (const event of events) {
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) takeEvent(line.slice(6), conversation, answer);
      }
    }
    fillBubble(bubble, answer);
    $("messages").scrollTop = $("messages").scrollHeight;
  }
}

async function send(text) {
  const conversation = currentConversation() ?? newConversation();
  if (!conversation.title) conversation.title = text.slice(0, 60);
  conversation.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "", state: "streaming" };
  conversation.messages.push(answer);
  conversation.updated = Date.now();
  saveConversations();
  renderAll();
  const bubble = $("messages").lastElementChild;
  state.controller = new AbortController();
  setBusy(true);
  try {
    await streamAnswer(conversation, answer, bubble, state.controller.signal);
    answer.state = answer.finish === "length" ? "length" : "done";
  } catch (error) {
    if (error.name === "AbortError") answer.state = "stopped";
    else answer.error = `the server answered: ${error.message}`;
  } finally {
    state.controller = null;
    setBusy(false);
    conversation.updated = Date.now();
    saveConversations();
    renderAll();
  }
}

// Stop: aborting the fetch closes the connection, and the server cancels the request.
function stop() {
  state.controller?.abort();
}

function startPage() {
  restoreSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    if (state.controller) return;
    state.currentId = null;
    renderAll();
    $("prompt").focus();
  });
  renderAll();
  connect();
}

startPage();
