// chatlane web chat: Markdown to safe DOM — marked parses, DOMPurify sanitizes,
// highlight.js colours code. Raw HTML in a message is shown as text, never rendered.
"use strict";

window.chatlaneMarkdown = (() => {
  const ALLOWED_TAGS = [
    "a", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6",
    "hr", "li", "ol", "p", "pre", "span", "strong", "table", "tbody", "td", "th",
    "thead", "tr", "ul",
  ];
  const ALLOWED_ATTR = ["href", "title", "class", "align", "start"];
  // DOMPurify's own rule with fewer schemes: http, https and mailto, or none (also
  // what every other attribute value is checked against, so "right" must pass)
  const SAFE_URL = /^(?:(?:https?|mailto):|[^a-z]|[a-z+.-]+(?:[^a-z+.\-:]|$))/i;

  function escapeHtml(text) {
    const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
    return String(text).replace(/[&<>"']/g, (c) => entities[c]);
  }

  const parser = new marked.Marked({
    gfm: true,
    breaks: true,
    async: false,
    renderer: {
      // raw HTML is text: what a message says is shown, never run
      html: (token) => (token.block ? `<p>${escapeHtml(token.text)}</p>` : escapeHtml(token.text)),
      // images are links: the page loads nothing a message names
      image: (token) =>
        `<a href="${escapeHtml(token.href)}">${escapeHtml(token.text || token.href)}</a>`,
    },
  });

  const purify = DOMPurify(window);
  purify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName !== "A") return;
    if (!node.hasAttribute("href")) return;
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  });

  function sanitize(html) {
    return purify.sanitize(html, {
      ALLOWED_TAGS,
      ALLOWED_ATTR,
      ALLOWED_URI_REGEXP: SAFE_URL,
      RETURN_DOM_FRAGMENT: true,
    });
  }

  function highlight(code) {
    const named = /(?:^|\s)language-([\w+#.-]+)/.exec(code.className);
    const language = named && hljs.getLanguage(named[1]) ? named[1] : null;
    if (!language) return named ? named[1] : "";
    const result = hljs.highlight(code.textContent, { language, ignoreIllegals: true });
    code.innerHTML = result.value; // highlight.js escapes the text it wraps
    code.classList.add("hljs");
    return language;
  }

  async function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return;
    }
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "visually-hidden";
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }

  function copyButton(code) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy code");
    button.addEventListener("click", async () => {
      try {
        await copy(code.textContent);
        button.textContent = "Copied";
      } catch {
        button.textContent = "Copy failed";
      }
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
    return button;
  }

  function codeBlock(pre) {
    const code = pre.querySelector("code") || pre;
    const language = highlight(code);
    const block = document.createElement("div");
    block.className = "code-block";
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const label = document.createElement("span");
    label.className = "code-language";
    label.textContent = language || "code";
    bar.append(label, copyButton(code));
    pre.replaceWith(block);
    block.append(bar, pre);
  }

  function wrapTable(table) {
    const scroller = document.createElement("div");
    scroller.className = "table-scroll";
    table.replaceWith(scroller);
    scroller.append(table);
  }

  /** Markdown `text` as a sanitized DocumentFragment, code highlighted, links opening apart. */
  function render(text) {
    const fragment = sanitize(parser.parse(String(text)));
    fragment.querySelectorAll("pre").forEach(codeBlock);
    fragment.querySelectorAll("table").forEach(wrapTable);
    return fragment;
  }

  return { render };
})();
