// The chat: one conversation at a time, sent to /v1/chat/completions as a stream. Stop aborts the fetch, which
// closes the connection, and the server aborts the request. Edit and regenerate cut the conversation at a turn
// and ask again. The conversations live in store.js; this file is the only one that changes them.

import { ApiError, streamEvents } from "./api.js";
import * as render from "./render.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "seed", "schema"];

let current = null; // the open conversation
let inFlight = null; // {controller, message} of the reply being streamed
let model = () => null; // the model picker's choice (app.js)

export function init(pickModel) {
  model = pickModel;
  const saved = store.loadSettings();
  for (const id of SETTINGS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("change", () => store.saveSettings(Object.fromEntries(SETTINGS.map((k) => [k, $(k).value]))));
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && inFlight) stop();
  });
  $("new-chat").addEventListener("click", () => open(store.create().id));
  $("export").addEventListener("click", store.exportAll);
  open(store.conversations[0]?.id ?? store.create().id);
}

function open(id) {
  if (inFlight) stop();
  current = store.conversations.find((c) => c.id === id);
  draw();
}

function draw() {
  render.conversationList($("conversations"), store.conversations, current.id, open);
  const list = $("messages");
  list.replaceChildren(...current.messages.map((m, i) => render.turn(m, actionsFor(i), inFlight?.message === m)));
  list.lastElementChild?.scrollIntoView({ block: "end" });
}

function actionsFor(i) {
  if (inFlight) return {};
  const m = current.messages[i];
  if (m.role === "user") return { Edit: () => edit(i) };
  return { Regenerate: () => regenerate(i) };
}

async function edit(i) {
  const text = await render.editor($("messages").children[i], current.messages[i].content);
  if (text === null || !text.trim()) return draw();
  current.messages.splice(i, current.messages.length - i, { role: "user", content: text });
  await generate();
}

async function regenerate(i) {
  current.messages.splice(i);
  await generate();
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || inFlight) return;
  $("prompt").value = "";
  if (!current.messages.length) current.title = text.slice(0, 40);
  current.messages.push({ role: "user", content: text });
  await generate();
}

function stop() {
  inFlight?.controller.abort();
}

// The request body from the conversation and the settings; throws an Error a person can read for a bad schema.
function requestBody() {
  const body = { model: model(), stream: true, stream_options: { include_usage: true } };
  const system = $("system").value.trim();
  body.messages = [...(system ? [{ role: "system", content: system }] : []),
    ...current.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }))];
  const numbers = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
  for (const [field, id] of Object.entries(numbers)) {
    if ($(id).value !== "") body[field] = Number($(id).value);
  }
  const schema = $("schema").value.trim();
  if (schema) {
    try {
      body.response_format = { type: "json_schema", json_schema: { name: "page", schema: JSON.parse(schema) } };
    } catch (e) {
      throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
    }
  }
  return body;
}

async function generate() {
  let body = null;
  let bad = null;
  try {
    body = requestBody(); // the conversation so far: before the reply's own turn joins it
  } catch (e) {
    bad = e;
  }
  const message = { role: "assistant", content: "", reasoning: "" };
  const controller = new AbortController();
  current.messages.push(message);
  current.updated = Date.now();
  inFlight = { controller, message };
  $("stop").disabled = false;
  $("send").disabled = true;
  draw();
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      if (inFlight?.message !== message) return; // it ended, and was drawn whole
      const list = $("messages");
      list.lastElementChild?.replaceWith(render.turn(message, {}, true));
      list.lastElementChild?.scrollIntoView({ block: "end" });
    });
  };
  try {
    if (bad) throw bad;
    for await (const chunk of streamEvents("/v1/chat/completions", body, controller.signal)) {
      const delta = chunk.choices?.[0]?.delta ?? {};
      message.content += delta.content ?? "";
      message.reasoning += delta.reasoning_content ?? "";
      if (chunk.usage) Object.assign(message, { usage: chunk.usage, timings: chunk.timings });
      redraw();
    }
  } catch (e) {
    if (e.name === "AbortError") message.stopped = true;
    else message.error = e instanceof ApiError ? `The server said: ${e.message}` : `Not sent: ${e.message}`;
  } finally {
    inFlight = null;
    $("stop").disabled = true;
    $("send").disabled = false;
    store.save();
    draw();
  }
}
