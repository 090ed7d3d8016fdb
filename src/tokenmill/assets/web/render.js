// Drawing one conversation: each turn's text as sanitised markdown, a reply's reasoning folded apart from its
// answer, and each reply's cost figures. Pure rendering: it reads turns and writes DOM, nothing else.

export function markdown(text) {
  // marked and DOMPurify are vendored (vendor/): no CDN, works offline. Raw HTML in a reply is sanitised away.
  return window.DOMPurify.sanitize(window.marked.parse(text || ""));
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

const fmt = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

// The reply's cost, from the final usage chunk: OpenAI's usage plus tokenmill's `timings` (docs/api.md).
export function figures(usage, timings) {
  const t = timings || {};
  const paths = Object.entries(t.forward_steps || {}).map(([name, steps]) => `${name} ×${steps}`).join(", ");
  const rows = [
    ["ttft", "TTFT", `${fmt(t.ttft_ms, 1)} ms`],
    ["decode", "Decode", `${fmt(t.decode_tokens_per_sec, 1)} tok/s`],
    ["prompt", "Prompt tokens", fmt(usage?.prompt_tokens)],
    ["cached", "Prefix-cache hits", fmt(usage?.prompt_tokens_details?.cached_tokens)],
    ["output", "Output tokens", fmt(usage?.completion_tokens)],
    ["drafts", "Drafted / accepted", `${fmt(t.draft_tokens)} / ${fmt(t.accepted_tokens)}`],
    ["path", "Forward path (steps)", paths || "–"],
  ];
  const list = el("dl", { class: "figures", "aria-label": "Reply figures" });
  for (const [key, label, value] of rows) {
    list.append(el("div", { "data-figure": key }, el("dt", { text: label }), el("dd", { text: value })));
  }
  return list;
}

// One turn. `actions` maps a button label to its handler; `live` marks the reply being streamed.
export function turn(message, actions, live) {
  const body = el("div", { class: "body" });
  body.innerHTML = markdown(message.content);
  const item = el("li", { class: `msg ${message.role}${live ? " live" : ""}` },
    el("div", { class: "role", text: message.role === "user" ? "You" : "Assistant" }));
  if (message.reasoning) {
    const thought = el("div", { class: "body" });
    thought.innerHTML = markdown(message.reasoning);
    item.append(el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }), thought));
  }
  item.append(body);
  if (message.error) item.append(el("p", { class: "error", role: "alert", text: message.error }));
  if (message.stopped) item.append(el("p", { class: "stopped", text: "Stopped." }));
  if (message.usage) item.append(figures(message.usage, message.timings));
  const bar = el("div", { class: "actions" });
  for (const [label, handler] of Object.entries(actions)) {
    bar.append(el("button", { type: "button", onclick: handler, text: label }));
  }
  if (bar.childElementCount) item.append(bar);
  return item;
}

// A user turn made editable in place: resolves with the new text, or null when cancelled.
export function editor(item, text) {
  return new Promise((resolve) => {
    const area = el("textarea", { rows: "3", "aria-label": "Edit message" });
    area.value = text;
    const done = (value) => () => resolve(value === undefined ? area.value : value);
    item.replaceChildren(area, el("div", { class: "actions" },
      el("button", { type: "button", onclick: done(), text: "Save and send" }),
      el("button", { type: "button", onclick: done(null), text: "Cancel" })));
    area.focus();
  });
}

export function conversationList(list, conversations, currentId, open) {
  list.replaceChildren(...conversations.map((c) => el("li", {},
    el("button", { type: "button", "aria-current": c.id === currentId ? "true" : "false", onclick: () => open(c.id),
      text: c.title }))));
}
