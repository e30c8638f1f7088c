// The chat page: conversations kept in this browser, answers streamed from /v1/chat/completions.
import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { html } from "htm/preact";
import { events, request } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import {
  deleteConversation,
  download,
  historyKept,
  listConversations,
  newConversation,
  saveConversation,
} from "./store.js";

const EFFORTS = ["none", "low", "medium", "high"];

// A stored message as the API wants it: pictures as image_url parts (data: URLs).
function apiMessage(message) {
  if (message.role === "user" && message.images?.length) {
    return {
      role: "user",
      content: [
        ...message.images.map((url) => ({ type: "image_url", image_url: { url } })),
        ...(message.content ? [{ type: "text", text: message.content }] : []),
      ],
    };
  }
  if (message.role === "assistant" && message.toolCalls?.length) {
    return {
      role: "assistant",
      content: message.content || null,
      tool_calls: message.toolCalls.map((call) => ({
        id: call.id,
        type: "function",
        function: { name: call.name, arguments: call.arguments },
      })),
    };
  }
  if (message.role === "tool") return { role: "tool", tool_call_id: message.toolCallId, content: message.content };
  return { role: message.role, content: message.content || "" };
}

// The conversation's tool definitions (a JSON list in the settings), or an Error saying what is wrong.
function parseTools(text) {
  if (!text?.trim()) return [];
  try {
    const tools = JSON.parse(text);
    if (Array.isArray(tools)) return tools;
  } catch {
    // reported below
  }
  return new Error("Tools must be a JSON list of tool definitions");
}

function requestBody(conversation, model) {
  const { settings } = conversation;
  const messages = conversation.messages.filter((m) => m.status !== "error").map(apiMessage);
  if (settings.system.trim()) messages.unshift({ role: "system", content: settings.system });
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  if (settings.temperature !== "" && settings.temperature !== null) body.temperature = Number(settings.temperature);
  if (settings.maxTokens) body.max_tokens = Number(settings.maxTokens);
  if (settings.reasoning) body.reasoning_effort = settings.reasoning;
  const tools = parseTools(settings.tools);
  if (tools instanceof Error) throw tools;
  if (tools.length) body.tools = tools;
  return body;
}

function readPictures(files) {
  return Promise.all(
    [...files]
      .filter((file) => file.type.startsWith("image/"))
      .map(
        (file) =>
          new Promise((resolve, reject) => {
            const reader = new FileReader();
            reader.onload = () => resolve(reader.result);
            reader.onerror = () => reject(reader.error);
            reader.readAsDataURL(file);
          }),
      ),
  );
}

function Markdown({ text }) {
  const rendered = useMemo(() => renderMarkdown(text), [text]);
  return html`<div class="markdown" dangerouslySetInnerHTML=${{ __html: rendered }}></div>`;
}

// A call the model made; while it has no result, a box to answer it with one.
function ToolCall({ call, answered, busy, onResult }) {
  const [result, setResult] = useState("");
  return html`<div class="tool-call" data-testid="tool-call">
    <span class="tool-name">${call.name}</span><code>${call.arguments}</code>
    ${!answered && !busy &&
    html`<form class="tool-result" onSubmit=${(e) => (e.preventDefault(), onResult(call, result))}>
      <input data-testid="tool-result" placeholder="the tool's result" value=${result}
        onInput=${(e) => setResult(e.target.value)} />
      <button type="submit">Send result</button>
    </form>`}
  </div>`;
}

// The text as the model wrote it, not as the page renders it. The clipboard API needs a secure context (https,
// or this machine) and the browser's leave; without them the text is copied through a selection.
async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}

function CopyButton({ text }) {
  const [copied, setCopied] = useState(false);
  const copy = async () => {
    await copyText(text);
    setCopied(true);
    setTimeout(() => setCopied(false), 1500);
  };
  return html`<button class="plain" data-testid="copy" onClick=${copy}>${copied ? "Copied" : "Copy"}</button>`;
}

function usageLine({ usage, finish }) {
  const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
  const end = finish ? `, ${finish}` : "";
  return `${usage.prompt_tokens} prompt tokens (${cached} cached), ${usage.completion_tokens} generated${end}`;
}

function Message({ message, last, busy, answered, onEdit, onRegenerate, onResult }) {
  const [editing, setEditing] = useState(null);
  if (editing !== null) {
    return html`<div class="message user editing">
      <textarea value=${editing} onInput=${(e) => setEditing(e.target.value)}></textarea>
      <div class="actions">
        <button onClick=${() => (onEdit(editing), setEditing(null))}>Save and send</button>
        <button class="plain" onClick=${() => setEditing(null)}>Cancel</button>
      </div>
    </div>`;
  }
  const status = message.status || "done";
  if (message.role === "tool") {
    return html`<div class="message tool" data-role="tool">
      <span class="tool-name">${message.name} →</span><code>${message.content}</code>
    </div>`;
  }
  return html`<div class="message ${message.role}" data-role=${message.role} data-status=${status}>
    ${message.images?.length > 0 &&
    html`<div class="pictures">${message.images.map((url) => html`<img src=${url} alt="picture" />`)}</div>`}
    ${message.reasoning &&
    html`<details class="thinking" open=${status === "streaming" && !message.content}>
      <summary>Thinking</summary>
      <div class="thinking-text">${message.reasoning}</div>
    </details>`}
    ${message.role === "assistant"
      ? html`<${Markdown} text=${message.content} />`
      : html`<div class="text">${message.content}</div>`}
    ${(message.toolCalls || []).map(
      (call) => html`<${ToolCall} call=${call} answered=${answered.has(call.id)} busy=${busy || !last}
        onResult=${onResult} />`,
    )}
    ${status === "stopped" && html`<div class="note stopped" data-testid="stopped">Stopped</div>`}
    ${status === "error" && html`<div class="note error">${message.error}</div>`}
    ${message.usage &&
    html`<div class="usage">${usageLine(message)}</div>`}
    ${!busy &&
    html`<div class="actions">
      ${message.role === "user" && html`<button class="plain" onClick=${() => setEditing(message.content)}>Edit</button>`}
      ${message.role === "assistant" && message.content && html`<${CopyButton} text=${message.content} />`}
      ${message.role === "assistant" && last &&
      html`<button class="plain" data-testid="regenerate" onClick=${onRegenerate}>Regenerate</button>`}
    </div>`}
  </div>`;
}

function Settings({ settings, onChange }) {
  const set = (key) => (e) => onChange({ ...settings, [key]: e.target.value });
  return html`<div class="settings" data-testid="settings">
    <label>System prompt<textarea value=${settings.system} onInput=${set("system")}></textarea></label>
    <label>Temperature<input type="number" min="0" max="2" step="0.1" value=${settings.temperature}
      onInput=${set("temperature")} /></label>
    <label>Reasoning effort<select value=${settings.reasoning} onChange=${set("reasoning")}>
      ${EFFORTS.map((effort) => html`<option value=${effort}>${effort}</option>`)}
    </select></label>
    <label>Max tokens<input type="number" min="1" step="1" value=${settings.maxTokens}
      onInput=${set("maxTokens")} /></label>
    <label class="wide">Tools (a JSON list of OpenAI tool definitions)<textarea value=${settings.tools || ""}
      onInput=${set("tools")}></textarea></label>
  </div>`;
}

export function Chat() {
  const [conversations, setConversations] = useState([]);
  const [current, setCurrent] = useState(null);
  const [, setTick] = useState(0);
  const [text, setText] = useState("");
  const [pictures, setPictures] = useState([]);
  const [model, setModel] = useState("");
  const [models, setModels] = useState([]); // a server of several models: each one's name and state
  const [problem, setProblem] = useState("");
  const [showSettings, setShowSettings] = useState(false);
  const [noHistory, setNoHistory] = useState(false); // this browser cannot keep conversations: said once
  const running = useRef(null); // the AbortController of the answer being streamed
  const bottom = useRef(null);
  const picker = useRef(null);
  const refresh = () => setTick((n) => n + 1);

  useEffect(() => {
    (async () => {
      setNoHistory(!(await historyKept()));
      const stored = await listConversations();
      setConversations(stored);
      setCurrent(stored[0] || newConversation());
      try {
        const listed = (await (await request("/v1/models")).json()).data;
        setModel(listed[0]?.id || "");
        if (listed.some((entry) => entry.aliases)) setModels(listed); // several models, each picked by name
      } catch (error) {
        setProblem(error.message);
      }
    })();
  }, []);

  useEffect(() => bottom.current?.scrollIntoView({ block: "end" }));

  async function store(conversation) {
    conversation.updated = Date.now();
    await saveConversation(conversation);
    setConversations(await listConversations());
  }

  async function answer(conversation) {
    const reply = { role: "assistant", content: "", reasoning: "", toolCalls: [], status: "streaming" };
    let body;
    try {
      body = requestBody(conversation, model);
    } catch (error) {
      setProblem(error.message);
      return;
    }
    conversation.messages.push(reply);
    const controller = new AbortController();
    running.current = controller;
    refresh();
    let pending = false;
    const redraw = () => {
      if (!pending) {
        pending = true;
        requestAnimationFrame(() => ((pending = false), refresh()));
      }
    };
    try {
      const response = await request("/v1/chat/completions", { body, signal: controller.signal });
      setProblem("");
      for await (const [, chunk] of events(response)) {
        if (chunk === null) break;
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) reply.usage = chunk.usage;
        const choice = chunk.choices?.[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.content) reply.content += delta.content;
        if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
        for (const call of delta.tool_calls || []) {
          const entry = (reply.toolCalls[call.index] ||= { id: call.id, name: "", arguments: "" });
          if (call.function?.name) entry.name = call.function.name;
          if (call.function?.arguments) entry.arguments += call.function.arguments;
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
        redraw();
      }
      reply.status = "done";
    } catch (error) {
      if (controller.signal.aborted) {
        reply.status = "stopped";
      } else {
        reply.status = "error";
        reply.error = error.message;
      }
    } finally {
      running.current = null;
      refresh();
      await store(conversation);
    }
  }

  async function send(event) {
    event?.preventDefault();
    if (running.current || (!text.trim() && !pictures.length)) return;
    const conversation = current;
    conversation.messages.push({ role: "user", content: text.trim(), images: pictures });
    if (conversation.title === "New chat") conversation.title = (text.trim() || "Picture").slice(0, 48);
    setText("");
    setPictures([]);
    await answer(conversation);
  }

  function stop() {
    running.current?.abort();
  }

  async function sendResult(call, content) {
    current.messages.push({ role: "tool", toolCallId: call.id, name: call.name, content });
    await answer(current);
  }

  async function regenerate() {
    const messages = current.messages;
    while (messages.length && messages[messages.length - 1].role !== "user") messages.pop();
    await answer(current);
  }

  async function edit(index, content) {
    const original = current.messages[index];
    current.messages.splice(index);
    current.messages.push({ ...original, content });
    await answer(current);
  }

  async function addPictures(files) {
    const urls = await readPictures(files);
    if (urls.length) setPictures((before) => [...before, ...urls]);
  }

  function onPaste(event) {
    const files = [...(event.clipboardData?.files || [])];
    if (files.some((file) => file.type.startsWith("image/"))) {
      event.preventDefault();
      addPictures(files);
    }
  }

  function onDrop(event) {
    event.preventDefault();
    addPictures(event.dataTransfer?.files || []);
  }

  async function remove(conversation) {
    await deleteConversation(conversation.id);
    const stored = await listConversations();
    setConversations(stored);
    if (conversation.id === current?.id) setCurrent(stored[0] || newConversation());
  }

  if (!current) return html`<main class="chat"></main>`;
  const busy = running.current !== null;
  const messages = current.messages;
  const answered = new Set(messages.filter((m) => m.role === "tool").map((m) => m.toolCallId));
  return html`<main class="chat" onDragOver=${(e) => e.preventDefault()} onDrop=${onDrop}>
    <aside class="sidebar">
      <button onClick=${() => !busy && setCurrent(newConversation())} disabled=${busy}>New chat</button>
      <ul class="conversations">
        ${conversations.map(
          (c) => html`<li class=${c.id === current.id ? "active" : ""}>
            <a onClick=${() => !busy && setCurrent(c)}>${c.title}</a>
            <button class="plain" title="Delete" onClick=${() => remove(c)}>×</button>
          </li>`,
        )}
      </ul>
      <button class="plain" onClick=${() => download("strata-conversations.json", conversations)}>
        Export all (JSON)
      </button>
      <button class="plain" onClick=${() => download(`strata-${current.id}.json`, current)}>
        Export this chat
      </button>
    </aside>
    <section class="conversation">
      <header>
        ${models.length > 1
          ? html`<select class="model" data-testid="model-picker" value=${model}
              onChange=${(event) => setModel(event.target.value)}>
              ${models.map((entry) => html`<option value=${entry.id}>${entry.id} (${entry.state})</option>`)}
            </select>`
          : html`<span class="model">${model || "…"}</span>`}
        <button class="plain" onClick=${() => setShowSettings(!showSettings)}>Settings</button>
      </header>
      ${showSettings &&
      html`<${Settings} settings=${current.settings}
        onChange=${(settings) => ((current.settings = settings), refresh(), store(current))} />`}
      ${problem && html`<div class="problem">${problem}</div>`}
      ${noHistory &&
      html`<div class="notice" data-testid="no-history">
        This browser does not let the page keep conversations (IndexedDB is not available, as in some private
        windows): they last until the page is closed.
        <button class="plain" title="Dismiss" onClick=${() => setNoHistory(false)}>×</button>
      </div>`}
      <div class="messages">
        ${messages.map(
          (message, i) => html`<${Message} message=${message} last=${i === messages.length - 1} busy=${busy}
            answered=${answered} onEdit=${(content) => edit(i, content)} onRegenerate=${regenerate}
            onResult=${sendResult} />`,
        )}
        <div ref=${bottom}></div>
      </div>
      <form class="composer" onSubmit=${send}>
        ${pictures.length > 0 &&
        html`<div class="pending">
          ${pictures.map(
            (url, i) => html`<span class="thumb"><img src=${url} alt="picture to send" />
              <button type="button" class="plain" onClick=${() => setPictures(pictures.filter((_, j) => j !== i))}>
                ×</button></span>`,
          )}
        </div>`}
        <textarea data-testid="prompt" placeholder="Ask something; paste or drop a picture" value=${text}
          onInput=${(e) => setText(e.target.value)} onPaste=${onPaste}
          onKeyDown=${(e) => e.key === "Enter" && !e.shiftKey && send(e)}></textarea>
        <input type="file" accept="image/*" multiple hidden ref=${picker}
          onChange=${(e) => (addPictures(e.target.files), (e.target.value = ""))} />
        <button type="button" class="plain" onClick=${() => picker.current.click()}>Picture…</button>
        ${busy
          ? html`<button type="button" class="stop" data-testid="stop" onClick=${stop}>Stop</button>`
          : html`<button type="submit" data-testid="send">Send</button>`}
      </form>
    </section>
  </main>`;
}
