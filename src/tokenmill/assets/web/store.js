// Conversations and settings, kept in this browser's localStorage. The one writer of both: the chat view reads
// them from here and saves through here.

const CONVERSATIONS = "tokenmill.conversations";
const SETTINGS = "tokenmill.settings";

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback; // a damaged entry starts afresh rather than breaking the page
  }
}

export const conversations = load(CONVERSATIONS, []); // [{id, title, messages: [{role, content, ...}], updated}]

export function save() {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations));
}

export function create() {
  const conv = { id: crypto.randomUUID(), title: "New chat", messages: [], updated: Date.now() };
  conversations.unshift(conv);
  save();
  return conv;
}

export function remove(id) {
  const i = conversations.findIndex((c) => c.id === id);
  if (i >= 0) conversations.splice(i, 1);
  save();
}

export function loadSettings() {
  return load(SETTINGS, {});
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

// Every conversation as one JSON file the browser downloads.
export function exportAll() {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `tokenmill-conversations-${new Date().toISOString().slice(0, 19)}.json`;
  link.click();
  URL.revokeObjectURL(link.href);
}
