// Markdown to DOM for model answers. It builds elements and text nodes only: no innerHTML, no attribute taken
// from the text except a link's href, and that only for http(s) and mailto. So whatever a model writes
// (<script>, onerror=, javascript: links) ends up as visible text, never as markup.
"use strict";

(function () {
  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function el(tag, children, cls) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    for (const c of children || []) node.append(c);
    return node;
  }

  function safeHref(raw) {
    try {
      const url = new URL(raw, "http://invalid.invalid/");
      if (["http:", "https:", "mailto:"].includes(url.protocol) && !url.host.endsWith("invalid.invalid")) return url.href;
    } catch (_) { /* not a URL: shown as text */ }
    return null;
  }

  // Inline spans: code, bold, italic, strike, links, bare URLs. Everything else is text.
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|(?<![\w])__(?=\S)([\s\S]*?\S)__(?![\w])|\*(?=\S)([^*]*?\S)\*|(?<![\w])_(?=\S)([^_]*?\S)_(?![\w])|~~(?=\S)([\s\S]*?\S)~~|\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)|(https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"])/;

  function inline(text) {
    const out = [];
    let rest = text;
    while (rest.length) {
      const m = INLINE.exec(rest);
      if (!m) { pushText(out, rest); break; }
      if (m.index) pushText(out, rest.slice(0, m.index));
      if (m[1] !== undefined) out.push(el("code", [m[2].replace(/^ (.*) $/, "$1")]));
      else if (m[3] !== undefined || m[4] !== undefined) out.push(el("strong", inline(m[3] ?? m[4])));
      else if (m[5] !== undefined || m[6] !== undefined) out.push(el("em", inline(m[5] ?? m[6])));
      else if (m[7] !== undefined) out.push(el("del", inline(m[7])));
      else if (m[8] !== undefined) out.push(link(inline(m[8]), m[9], m[0]));
      else out.push(link([m[10]], m[10], m[10]));
      rest = rest.slice(m.index + m[0].length);
    }
    return out;
  }

  function pushText(out, text) {
    // a line break inside a paragraph is kept as one
    const lines = text.split("\n");
    lines.forEach((line, i) => {
      if (i) out.push(document.createElement("br"));
      if (line) out.push(document.createTextNode(line));
    });
  }

  function link(children, href, original) {
    const safe = safeHref(href);
    if (!safe) return document.createTextNode(original);
    const a = el("a", children);
    a.href = safe;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    return a;
  }

  function codeBlock(lang, lines) {
    const code = el("code", [lines.join("\n")]);
    if (lang) code.dataset.lang = lang;
    const copy = el("button", ["Copy"], "copy-code");
    copy.type = "button";
    copy.addEventListener("click", () => {
      navigator.clipboard?.writeText(code.textContent).then(() => { copy.textContent = "Copied"; }, () => { copy.textContent = "Copy failed"; });
    });
    const head = el("div", [el("span", [lang || "code"]), copy], "code-head");
    return el("div", [head, el("pre", [code])], "code-block");
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function blocks(lines) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const fence = m[1], body = [];
        i++;
        while (i < lines.length && !new RegExp("^\\s{0,3}" + fence[0] + "{" + fence.length + ",}\\s*$").test(lines[i])) body.push(lines[i++]);
        i++; // the closing fence (absent while an answer is still streaming)
        out.push(codeBlock(m[2], body));
      } else if ((m = HEADING.exec(line))) {
        out.push(el("h" + Math.min(6, m[1].length + 2), inline(m[2])));  // h1/h2 belong to the page
        i++;
      } else if (RULE.test(line)) {
        out.push(document.createElement("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) { body.push(m[1]); i++; }
        out.push(el("blockquote", blocks(body)));
      } else if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const indent = m[1].length;
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        while (i < lines.length) {
          const item = ITEM.exec(lines[i]);
          if (!item || item[1].length !== indent || /\d/.test(item[2]) !== ordered) break;
          const body = [item[3]];
          i++;
          // the item goes on over indented lines (nested lists, continued text) and lazy continuation lines
          while (i < lines.length) {
            const next = lines[i];
            if (!next.trim()) {
              if (i + 1 < lines.length && /^\s+/.test(lines[i + 1]) && lines[i + 1].search(/\S/) > indent) { body.push(""); i++; continue; }
              break;
            }
            const nextItem = ITEM.exec(next);
            if (nextItem && nextItem[1].length <= indent) break;
            if (!nextItem && !/^\s/.test(next) && isBlockStart(next)) break;
            body.push(next.slice(Math.min(next.search(/\S/), indent + 2)));
            i++;
          }
          const content = blocks(body);
          // a tight item's single paragraph is shown without the paragraph's margins
          if (content.length && content[0].tagName === "P" && !body.includes("")) {
            const p = content.shift();
            content.unshift(...p.childNodes);
          }
          list.append(el("li", content));
        }
        out.push(list);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        const head = splitRow(line);
        i += 2;
        const rows = [];
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(splitRow(lines[i++]));
        const thead = el("thead", [el("tr", head.map((c) => el("th", inline(c))))]);
        const tbody = el("tbody", rows.map((r) => el("tr", head.map((_, k) => el("td", inline(r[k] ?? ""))))));
        out.push(el("div", [el("table", [thead, tbody])], "table-wrap"));
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && !(para.length && isBlockStart(lines[i]))) para.push(lines[i++].trim());
        out.push(el("p", inline(para.join("\n"))));
      }
    }
    return out;
  }

  // renderMarkdown(text) -> DocumentFragment
  window.renderMarkdown = function renderMarkdown(text) {
    const fragment = document.createDocumentFragment();
    fragment.append(...blocks(String(text).replace(/\r\n?/g, "\n").split("\n")));
    return fragment;
  };
})();
