import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { html } from "htm/preact";
import { onKeyNeeded } from "./api.js";
import { Chat } from "./chat.js";
import { Monitor } from "./monitor.js";
import "highlight.js/styles/github.css";
import "./style.css";

// The API key dialog: shown when the server answers 401, once; the key is kept in this browser.
function KeyDialog({ ask }) {
  const [key, setKey] = useState("");
  const submit = (event) => {
    event.preventDefault();
    if (key.trim()) ask.resolve(key.trim());
  };
  return html`<div class="overlay">
    <form class="dialog" data-testid="key-dialog" onSubmit=${submit}>
      <h2>API key</h2>
      <p>This server needs an API key (the monitor also takes its status key). It is kept in this browser and
        sent with every request.</p>
      <input type="password" data-testid="api-key" autofocus placeholder="API key" value=${key}
             onInput=${(e) => setKey(e.target.value)} />
      <button type="submit">Use this key</button>
    </form>
  </div>`;
}

function App() {
  const [ask, setAsk] = useState(null);
  useEffect(() => {
    onKeyNeeded(
      () =>
        new Promise((resolve) =>
          setAsk({ resolve: (key) => (setAsk(null), resolve(key)) }),
        ),
    );
  }, []);
  const page = location.pathname.replace(/\/+$/, "") === "/monitor" ? "monitor" : "chat";
  return html`<div class="app">
    <nav class="top">
      <span class="brand">Strata</span>
      <a href="/" class=${page === "chat" ? "active" : ""}>Chat</a>
      <a href="/monitor" class=${page === "monitor" ? "active" : ""}>Monitor</a>
    </nav>
    ${page === "monitor" ? html`<${Monitor} />` : html`<${Chat} />`}
    ${ask && html`<${KeyDialog} ask=${ask} />`}
  </div>`;
}

render(html`<${App} />`, document.getElementById("app"));
