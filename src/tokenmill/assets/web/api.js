// The page's one door to the server: tokenmill's public HTTP API, called as any client would, with the API key
// the user gave (kept in this browser's localStorage). Every failure becomes an ApiError whose message a person
// can read: the server's own OpenAI-style error message where there is one.

const KEY_STORE = "tokenmill.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status; // the HTTP status; 0 when the server could not be reached or the stream broke
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  localStorage.setItem(KEY_STORE, key);
}

function headers() {
  const h = { "content-type": "application/json" };
  const key = apiKey();
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    const said = body?.error?.message ?? body?.detail ?? body?.status;
    if (said) message = `${resp.status}: ${typeof said === "string" ? said : JSON.stringify(said)}`;
  } catch {
    // not JSON: the status line says enough
  }
  if (resp.status === 401) window.dispatchEvent(new CustomEvent("tokenmill:unauthorized"));
  const retry = resp.headers.get("retry-after");
  return new ApiError(resp.status, retry ? `${message} (retry after ${retry} s)` : message);
}

async function call(path, init = {}) {
  let resp;
  try {
    resp = await fetch(path, { ...init, headers: headers() });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, `cannot reach the server (${e.message})`);
  }
  if (!resp.ok) throw await errorOf(resp);
  return resp;
}

export async function getJSON(path) {
  return (await call(path)).json();
}

export async function getText(path) {
  return (await call(path)).text();
}

// POST a streaming request and yield each `data:` JSON payload of its server-sent events until `[DONE]`.
// Aborting `signal` closes the connection, which makes the server abort the request.
export async function* streamEvents(path, body, signal) {
  const resp = await call(path, { method: "POST", body: JSON.stringify(body), signal });
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (e) {
        if (e.name === "AbortError") throw e;
        throw new ApiError(0, `the connection to the server broke mid-reply (${e.message})`);
      }
      if (chunk.done) break;
      buffer += chunk.value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new ApiError(payload.error.code || 500, payload.error.message);
        yield payload;
      }
    }
  } finally {
    reader.releaseLock();
  }
  throw new ApiError(0, "the server ended the stream before the reply was complete");
}
