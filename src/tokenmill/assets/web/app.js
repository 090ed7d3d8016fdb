// The page's entry: the API key prompt, the model picker, and the two views (chat.js, engine.js).

import { apiKey, getJSON, setApiKey } from "./api.js";
import * as chat from "./chat.js";
import * as engine from "./engine.js";

const $ = (id) => document.getElementById(id);

export function notice(message) {
  $("notice").textContent = message;
  $("notice").hidden = !message;
}

function askForKey() {
  $("key-form").hidden = false;
  $("key-input").value = apiKey();
  $("key-input").focus();
}

async function loadModels() {
  try {
    const { data } = await getJSON("/v1/models");
    const picker = $("model");
    const chosen = picker.value;
    picker.replaceChildren(...data.map((m) => new Option(`${m.id} (context ${m.max_model_len})`, m.id)));
    if (data.some((m) => m.id === chosen)) picker.value = chosen;
    notice("");
  } catch (e) {
    notice(`Could not list the models: ${e.message}`);
  }
}

function show(view) {
  const chatOn = view === "chat";
  $("chat-view").hidden = !chatOn;
  $("engine-view").hidden = chatOn;
  $("tab-chat").setAttribute("aria-pressed", String(chatOn));
  $("tab-engine").setAttribute("aria-pressed", String(!chatOn));
  if (chatOn) engine.stop();
  else engine.start(notice);
}

function main() {
  window.addEventListener("tokenmill:unauthorized", askForKey);
  $("key-button").addEventListener("click", askForKey);
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setApiKey($("key-input").value.trim());
    $("key-form").hidden = true;
    notice("");
    loadModels();
  });
  $("tab-chat").addEventListener("click", () => show("chat"));
  $("tab-engine").addEventListener("click", () => show("engine"));
  chat.init(() => $("model").value || null);
  loadModels();
}

main();
