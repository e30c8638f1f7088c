// The server's public API, as any client uses it: JSON requests with the API key (asked for once, when the
// server answers 401, and kept in this browser), and server-sent events read from a fetch body (EventSource
// cannot send the key).

const KEY = "strata.apiKey";

export class Unauthorized extends Error {}

let askForKey = null; // set by the page: () => Promise<string>, resolves with the key the person typed

export function onKeyNeeded(ask) {
  askForKey = ask;
}

function headers(extra = {}) {
  const key = localStorage.getItem(KEY);
  return { ...extra, ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

// fetch() with the key; on 401 asks for a key once and tries again.
export async function request(path, { body, signal, method } = {}) {
  for (let attempt = 0; ; attempt++) {
    const init = {
      method: method || (body === undefined ? "GET" : "POST"),
      headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    };
    const response = await fetch(path, init);
    if (response.status !== 401 || attempt > 0 || !askForKey) {
      if (!response.ok) throw await apiError(response);
      return response;
    }
    localStorage.setItem(KEY, await askForKey());
  }
}

async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message || message;
  } catch {
    // not JSON: the status line says enough
  }
  const error = response.status === 401 ? new Unauthorized(message) : new Error(message);
  error.status = response.status;
  return error;
}

// Yields [event name, parsed data] for each server-sent event of a response body.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = null;
      const data = [];
      for (const line of block.split("\n")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = text;
        else if (field === "data") data.push(text);
      }
      if (!data.length) continue;
      const joined = data.join("\n");
      yield [name, joined === "[DONE]" ? null : JSON.parse(joined)];
    }
  }
}
