// A small markdown renderer for the chat page: paragraphs, headings, lists, bold, italic,
// inline code, fenced code blocks and links. Every piece of the text is HTML-escaped before
// any tag is added, so a model's answer can never inject markup into the page.
"use strict";

const HTML_ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (ch) => HTML_ESCAPES[ch]);
}

// Links may point only at the web, mail or the page's own server: never javascript: or data:.
function safeUrl(url) {
  return /^(https?:|mailto:|\/|#)/i.test(url) ? url : null;
}

// Inline spans of an escaped line. Code spans are cut out first so nothing inside them is
// read as emphasis or a link.
function renderInline(escaped) {
  const codes = [];
  let text = escaped.replace(/`([^`]+)`/g, (_, code) => {
    codes.push(`<code>${code}</code>`);
    return `\u0000${codes.length - 1}\u0000`;
  });
  text = text.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
    const href = safeUrl(url);
    return href === null ? whole : `<a href="${href}" target="_blank" rel="noopener noreferrer">${label}</a>`;
  });
  text = text.replace(/\*\*([^*]+)\*\*|__([^_]+)__/g, (_, a, b) => `<strong>${a ?? b}</strong>`);
  text = text.replace(/\*([^*]+)\*|\b_([^_]+)_\b/g, (_, a, b) => `<em>${a ?? b}</em>`);
  return text.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
}

const FENCE = /^\s*```\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;

// A fenced code block from lines[start] (the opening fence); an answer still streaming may not
// have closed it yet, so it runs to the end. Returns [html, the index after the block].
function codeBlock(lines, start) {
  const language = lines[start].match(FENCE)[1];
  let end = start + 1;
  while (end < lines.length && !FENCE.test(lines[end])) end++;
  const body = escapeHtml(lines.slice(start + 1, end).join("\n"));
  const label = language ? ` data-language="${escapeHtml(language)}"` : "";
  return [`<pre${label}><code>${body}</code></pre>`, end + 1];
}

// A run of list items of one kind (bulleted or numbered) from lines[start].
function listBlock(lines, start) {
  const pattern = BULLET.test(lines[start]) ? BULLET : NUMBERED;
  const tag = pattern === BULLET ? "ul" : "ol";
  const items = [];
  let i = start;
  for (; i < lines.length && pattern.test(lines[i]); i++) {
    items.push(`<li>${renderInline(escapeHtml(lines[i].match(pattern)[1]))}</li>`);
  }
  return [`<${tag}>${items.join("")}</${tag}>`, i];
}

// Lines up to the next blank line or the start of another kind of block.
function paragraphBlock(lines, start) {
  let i = start;
  const kept = [];
  while (i < lines.length && lines[i].trim() !== "" && (i === start || !startsBlock(lines[i]))) {
    kept.push(renderInline(escapeHtml(lines[i].trim())));
    i++;
  }
  return [`<p>${kept.join("<br>")}</p>`, i];
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line);
}

/** The HTML of a markdown text (escaped: the only tags in it are the renderer's own). */
function renderMarkdown(text) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let block;
    if (line.trim() === "") {
      i++;
      continue;
    } else if (FENCE.test(line)) {
      block = codeBlock(lines, i);
    } else if (HEADING.test(line)) {
      const [, hashes, title] = line.match(HEADING);
      block = [`<h${hashes.length}>${renderInline(escapeHtml(title))}</h${hashes.length}>`, i + 1];
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      block = listBlock(lines, i);
    } else {
      block = paragraphBlock(lines, i);
    }
    blocks.push(block[0]);
    i = block[1];
  }
  return blocks.join("\n");
}
