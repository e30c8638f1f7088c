// The monitor page: the engine live, from the server's status stream (/v1/status/stream): every slot, the queue,
// every request in flight with its phase, the image encoder, the recent requests; with several models, each
// one's state and slots; a single model's state (and its download, an "hf:" model's) beside its name.
import { useEffect, useRef, useState } from "preact/hooks";
import { html } from "htm/preact";
import { events, request } from "./api.js";

const WINDOW_S = 300; // the plots show the last five minutes
const INTERVAL_S = 0.25;

function Plot({ samples, field, label, unit }) {
  const width = 320;
  const height = 72;
  const now = samples.length ? samples[samples.length - 1].t : 0;
  // The time axis spans what was seen so far, from 30 s up to the whole window.
  const span = Math.min(WINDOW_S, Math.max(30, samples.length ? now - samples[0].t : 0));
  const top = Math.max(1, ...samples.map((s) => s[field]));
  const points = samples
    .map((s) => {
      const x = width - ((now - s.t) / span) * width;
      const y = height - (s[field] / top) * (height - 4);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(" ");
  const latest = samples.length ? samples[samples.length - 1][field] : 0;
  return html`<figure class="plot" data-testid=${`plot-${field}`}>
    <figcaption>${label}: <b>${latest.toFixed(field === "queued" ? 0 : 1)}</b> ${unit}
      <span class="scale">${` (max ${top.toFixed(0)}, last ${Math.round(span)} s)`}</span></figcaption>
    <svg viewBox="0 0 ${width} ${height}" width=${width} height=${height}>
      <polyline points=${points} />
    </svg>
  </figure>`;
}

function Progress({ done, total }) {
  if (!total) return html`<span class="dim">–</span>`;
  return html`<span class="progress">
    <progress value=${done} max=${total}></progress> ${done} / ${total}
  </span>`;
}

const age = (since) => (Date.now() / 1000 - since).toFixed(1);
const finishedLine = (totals) =>
  `${totals.requests} finished (${Object.entries(totals.finishes).map(([k, v]) => `${k} ${v}`).join(", ") || "none"})`;
const rate = (value) => (value === null || value === undefined ? "–" : value.toFixed(1));
const short = (id) => id.slice(0, 8);

// Each of the engine's slots: idle, or processing a request's prompt, or generating its answer; and the
// positions of its KV cache (kept while idle, for the next request that continues them).
function Slots({ slots }) {
  return html`<table data-testid="slots">
    <thead><tr><th>slot</th><th>state</th><th>request</th><th>cached</th></tr></thead>
    <tbody>
      ${slots.map(
        (s) => html`<tr data-slot=${s.slot} data-state=${s.state}>
          <td>${s.slot}</td><td><span class="phase phase-${s.state}">${s.state}</span></td>
          <td class="mono">${s.request ? short(s.request) : "–"}</td><td>${s.cached_tokens}</td>
        </tr>`,
      )}
    </tbody>
  </table>`;
}

function Requests({ requests, trails }) {
  return html`<table data-testid="requests">
    <thead><tr><th>request</th><th>model</th><th>route</th><th>phase</th><th>slot</th><th>prompt</th><th>cached</th>
      <th>out</th><th>tok/s</th><th>s</th><th>phases seen</th></tr></thead>
    <tbody>
      ${requests.length === 0 && html`<tr><td colspan="11" class="dim">no request in flight</td></tr>`}
      ${requests.map(
        (r) => html`<tr data-request=${r.id} data-phase=${r.phase}>
          <td class="mono">${short(r.id)}</td><td>${r.model}</td><td>${r.route}</td>
          <td><span class="phase phase-${r.phase}">${r.phase}</span></td><td>${r.slot ?? "–"}</td>
          <td><${Progress} done=${r.prompt_done} total=${r.prompt_tokens} /></td>
          <td>${r.cached_tokens}</td><td>${r.output_tokens}</td><td>${rate(r.tokens_per_second)}</td>
          <td>${r.seconds.toFixed(1)}</td>
          <td class="trail" data-testid="trail">${(trails[r.id] || []).join(" → ")}</td>
        </tr>`,
      )}
    </tbody>
  </table>`;
}

function Recent({ rows, trails }) {
  return html`<table data-testid="recent">
    <thead><tr><th>request</th><th>model</th><th>route</th><th>finish</th><th>prompt</th><th>cached</th><th>out</th>
      <th>tok/s</th><th>s</th><th>phases seen</th></tr></thead>
    <tbody>
      ${rows.map(
        (r) => html`<tr data-request=${r.id} data-finish=${r.finish}>
          <td class="mono">${short(r.id)}</td><td>${r.model}</td><td>${r.route}</td>
          <td><span class="finish finish-${r.finish}">${r.finish}</span></td>
          <td>${r.prompt_tokens}</td><td>${r.reused_tokens}</td><td>${r.output_tokens}</td>
          <td>${rate(r.tokens_per_second)}</td><td>${r.duration.toFixed(2)}</td>
          <td class="trail">${(trails[r.id] || []).join(" → ")}</td>
        </tr>`,
      )}
    </tbody>
  </table>`;
}

// An "hf:" model's download while it runs: the file, its bytes, the rate and the time left.
function Download({ download: d }) {
  const mb = (bytes) => (bytes / 1e6).toFixed(1);
  return html`<span class="progress" data-testid="download">
    <progress value=${d.done} max=${d.total || 1}></progress>
    ${` ${d.file}: ${mb(d.done)} of ${mb(d.total)} MB, ${mb(d.bytes_per_second)} MB/s`}
    ${d.eta_seconds !== null ? `, ETA ${Math.round(d.eta_seconds)} s` : ""}
  </span>`;
}

// A model's state, whether it drains for a swap and how many wait for memory to use it, its download while
// one runs, and the error of a load that failed.
function ModelState({ model: m }) {
  return html`<span class="state state-${m.state.replace(" ", "-")}" data-testid="model-state">${m.state}</span>
    ${m.draining && html` <span class="dim" data-testid="draining">draining for a swap</span>`}
    ${m.waiting > 0 && html` <span class="dim">${m.waiting} waiting for memory</span>`}
    ${m.download && html` <${Download} download=${m.download} />`}
    ${m.error && html` <span class="error">${m.error}</span>`}`;
}

// A server of several models: each one's state, what it takes of models_memory, its slots and queue, its totals.
function Models({ models }) {
  const memory = models.memory;
  const gib = (bytes) => (bytes / 2 ** 30).toFixed(2);
  return html`<section data-testid="models">
    <h3>Models</h3>
    <p class="dim">${memory.budget
      ? `${gib(memory.taken)} of ${gib(memory.budget)} GiB of models_memory taken`
      : `${gib(memory.taken)} GiB taken (no models_memory bound)`}</p>
    <table>
      <thead><tr><th>model</th><th>state</th><th>GiB</th><th>using</th><th>slots busy</th><th>queue</th>
        <th>requests</th><th>generated</th></tr></thead>
      <tbody>
        ${models.data.map(
          (m) => html`<tr data-model=${m.name} data-state=${m.state}>
            <td>${m.name}${m.aliases.length ? html` <span class="dim">(${m.aliases.join(", ")})</span>` : ""}</td>
            <td><${ModelState} model=${m} /></td>
            <td>${gib(m.footprint)}</td><td>${m.users}</td>
            <td>${m.slots.filter((slot) => slot.state !== "idle").length} of ${m.slots.length}</td>
            <td>${m.queued}</td><td>${m.totals ? m.totals.requests : 0}</td>
            <td>${m.totals ? m.totals.output_tokens : 0}</td>
          </tr>`,
        )}
      </tbody>
    </table>
    ${models.data
      .filter((m) => m.slots.length)
      .map((m) => html`<h4>${m.name}: slots</h4><${Slots} slots=${m.slots} />`)}
  </section>`;
}

function Encoder({ vision }) {
  if (!vision || vision.mode === "off") return html`<p class="dim">no image encoder configured</p>`;
  const job = vision.job;
  return html`<dl class="facts" data-testid="encoder">
    <dt>mode</dt><dd>${vision.mode}${vision.cuda ? " (CUDA)" : ""}</dd>
    <dt>state</dt><dd><span class="state state-${vision.state}">${vision.state}</span></dd>
    <dt>job</dt><dd>${job ? `encoding ${(job.bytes / 1024).toFixed(0)} kB for ${age(job.started)} s` : "none"}</dd>
    <dt>waiting</dt><dd>${vision.queued}</dd>
    <dt>encoded</dt><dd>${vision.encodes} (${vision.cache_hits} from cache)</dd>
    <dt>threads</dt><dd>${vision.threads ?? "–"} of ${vision.cores} cores</dd>
    ${vision.last_error && html`<dt>error</dt><dd class="error">${vision.last_error}</dd>`}
  </dl>`;
}

export function Monitor() {
  const [status, setStatus] = useState(null);
  const [problem, setProblem] = useState("");
  const samples = useRef([]);
  const trails = useRef({}); // request id -> phases seen, in order

  useEffect(() => {
    const controller = new AbortController();
    (async () => {
      while (!controller.signal.aborted) {
        try {
          const response = await request(`/v1/status/stream?interval=${INTERVAL_S}`, { signal: controller.signal });
          setProblem("");
          for await (const [, snapshot] of events(response)) {
            for (const r of snapshot.requests) {
              const trail = (trails.current[r.id] ||= []);
              if (trail[trail.length - 1] !== r.phase) trail.push(r.phase);
            }
            samples.current.push({
              t: snapshot.time,
              rate: snapshot.decode_tokens_per_second,
              queued: snapshot.queued,
            });
            while (samples.current.length && samples.current[0].t < snapshot.time - WINDOW_S) samples.current.shift();
            setStatus(snapshot);
          }
        } catch (error) {
          if (controller.signal.aborted) return;
          setProblem(`status stream: ${error.message}; retrying`);
        }
        await new Promise((resolve) => setTimeout(resolve, 2000));
      }
    })();
    return () => controller.abort();
  }, []);

  if (!status) return html`<main class="monitor"><p class="dim">${problem || "connecting…"}</p></main>`;
  const totals = status.totals;
  // With several models: every model's slots and queue together (each one's own in the models table).
  const named = status.models.memory.named;
  const slots = named ? status.models.data.flatMap((m) => m.slots) : status.slots;
  const queued = named ? status.models.data.reduce((sum, m) => sum + m.queued, 0) : status.queued;
  const busySlots = slots.filter((slot) => slot.state !== "idle").length;
  return html`<main class="monitor">
    ${problem && html`<div class="problem">${problem}</div>`}
    <section class="cards">
      <div class="card" data-testid="engine">
        <h3>Engine</h3>
        <dl class="facts">
          <dt>${named ? "models" : "model"}</dt>
          <dd>${named ? status.models.data.map((m) => m.name).join(", ") : html`${status.model}
            <${ModelState} model=${status.models.data[0]} />`}</dd>
          <dt>slots</dt><dd data-testid="slots-busy">${busySlots} of ${slots.length} busy</dd>
          <dt>queue</dt><dd data-testid="queued">${queued} waiting</dd>
          <dt>requests</dt><dd>${finishedLine(totals)}</dd>
          <dt>tokens</dt>
          <dd>${`${totals.prompt_tokens} prompt, ${totals.reused_tokens} cached, ${totals.output_tokens} generated`}</dd>
        </dl>
      </div>
      <div class="card"><h3>Image encoder</h3><${Encoder} vision=${status.vision} /></div>
      <div class="card plots">
        <${Plot} samples=${samples.current} field="rate" label="decode" unit="tok/s" />
        <${Plot} samples=${samples.current} field="queued" label="queue" unit="waiting" />
      </div>
    </section>
    ${named
      ? html`<${Models} models=${status.models} />`
      : html`<h3>Slots</h3><${Slots} slots=${status.slots} />`}
    <h3>In flight</h3>
    <${Requests} requests=${status.requests} trails=${trails.current} />
    <h3>Recent</h3>
    <${Recent} rows=${status.recent} trails=${trails.current} />
  </main>`;
}
