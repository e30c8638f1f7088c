// Model text to safe HTML: Markdown (marked), code highlighted (highlight.js), sanitised (DOMPurify), since the
// text comes from a model and may contain anything.
//
// The page shows what the model wrote: Markdown that would turn text into nothing shows the text itself (a lone
// "4.", "1)", "-" or "*" is an empty list item, "#" an empty heading, ">" an empty quote, "[a]: url" a link
// definition, a bare fence an empty code block), and HTML shows as text, not as elements (a model that writes
// "<br>" or "<think>" in an answer means those characters; as elements they would vanish or act).
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/common";
import { Marked } from "marked";

const ENTITIES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escape = (text) => text.replace(/[&<>"']/g, (c) => ENTITIES[c]);
const blank = (text) => !text || !text.trim();
// Markdown source shown as it was written: a paragraph, its lines kept (as `breaks` keeps them elsewhere).
const asText = (raw) => `<p>${escape(raw.trim()).replace(/\n/g, "<br>")}</p>\n`;

// A renderer returning false falls back to marked's own.
const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    code({ text, lang, raw }) {
      if (blank(text)) return asText(raw);
      const language = lang && hljs.getLanguage(lang) ? lang : null;
      const html = language ? hljs.highlight(text, { language }).value : hljs.highlightAuto(text).value;
      const label = language ? ` data-lang="${language}"` : "";
      return `<pre${label}><code class="hljs">${html}</code></pre>`;
    },
    heading: ({ text, raw }) => (blank(text) ? asText(raw) : false),
    blockquote: ({ text, raw }) => (blank(text) ? asText(raw) : false),
    list: ({ items, raw }) => (items.every((item) => blank(item.text)) ? asText(raw) : false),
    def: ({ raw }) => asText(raw),
    html: ({ text, block }) => (block ? asText(text) : escape(text)),
    // A task list's box as the characters the model wrote: inputs are not allowed in an answer (below).
    checkbox: ({ checked }) => (checked ? "[x] " : "[ ] "),
  },
});

// Nothing in an answer can be filled in or submitted: a form there could ask for the API key and send it
// elsewhere. Markdown makes none of these and HTML shows as text, so this guards against a renderer change; the
// content policy's `form-action 'none'` is the other half.
const SANITISE = { FORBID_TAGS: ["form", "input", "button", "textarea", "select"] };

export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""), SANITISE);
}
