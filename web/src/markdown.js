// Model text to safe HTML: Markdown (marked), code highlighted (highlight.js), sanitised (DOMPurify), since the
// text comes from a model and may contain anything.
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/common";
import { Marked } from "marked";

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    code({ text, lang }) {
      const language = lang && hljs.getLanguage(lang) ? lang : null;
      const html = language ? hljs.highlight(text, { language }).value : hljs.highlightAuto(text).value;
      const label = language ? ` data-lang="${language}"` : "";
      return `<pre${label}><code class="hljs">${html}</code></pre>`;
    },
  },
});

export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""));
}
