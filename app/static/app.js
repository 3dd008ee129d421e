// Colibri's chat page: plain JavaScript, no build step. Streams tokens from
// /v1/chat/completions (server-sent events read with fetch) and shows them as they come.
// The conversation always fits the model's context: before each request the prompt is
// counted with /tokenize, the oldest turns are left out until prompt + max tokens fit, and
// when the newest message alone leaves less room, max_tokens is capped to what is left.
// A turn that fails is shown but never sent again; "New chat" starts over.
"use strict";

const $ = (id) => document.getElementById(id);
let history = []; // [{role, content, el}] turns that went well, oldest first
let controller = null;
let chatId = 0; // bumped by "New chat", so a reply still streaming is not kept
let modelName = null;
let contextSize = null; // tokens, from /v1/models
window.lastRequest = null; // the last request sent (the browser test reads it)

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

// The server answered 401: unfold the settings, where the key goes, and say what it wants.
function keyNeeded() {
  const box = $("api-key").closest("details");
  if (!box.open) {
    box.open = true;
    $("api-key").focus();
  }
  return $("api-key").value.trim()
    ? "the server refused this API key: check it under Settings"
    : "this server needs an API key: enter it under Settings";
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      $("model").textContent = keyNeeded();
      return; // the key field's change event asks again
    }
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    modelName = body.data[0].id;
    contextSize = body.data[0].max_model_len || null;
    $("model").textContent = modelName;
    $("ctx").textContent = contextSize ? "context " + contextSize + " tokens" : "";
  } catch (e) {
    $("model").textContent = "model unavailable: " + e.message;
    setTimeout(loadModel, 2000);
  }
}

async function errorMessage(r) {
  if (r.status === 401) return keyNeeded();
  const body = await r.json().catch(() => ({}));
  return body.error ? body.error.message : r.status + " " + r.statusText;
}

function systemMessages() {
  const system = $("system").value.trim();
  return system ? [{ role: "system", content: system }] : [];
}

// Tokens the chat prompt of these messages takes (with the assistant's opening).
async function countTokens(messages) {
  const r = await fetch("/tokenize", {
    method: "POST", headers: headers(),
    body: JSON.stringify({ model: modelName || undefined, messages }),
  });
  if (!r.ok) throw new Error(await errorMessage(r));
  return (await r.json()).count;
}

// The turns to send and max_tokens for them: oldest turns left out until it fits.
async function fitToContext(user, wanted) {
  const plain = (turns) => systemMessages().concat(turns.map(({ role, content }) => ({ role, content })));
  let turns = history.concat([user]);
  let count = await countTokens(plain(turns));
  if (!contextSize) return { turns, maxTokens: wanted, count, dropped: 0 };
  let dropped = 0;
  while (count + wanted > contextSize && turns.length > 1) {
    // leave out the oldest exchange (a user turn and the reply that follows it)
    const cut = turns.length > 2 && turns[1].role === "assistant" ? 2 : 1;
    dropped += cut;
    turns = turns.slice(cut);
    count = await countTokens(plain(turns));
  }
  const room = contextSize - count;
  if (room < 1) {
    throw new Error("this message takes " + count + " tokens; the model's context holds " +
                    contextSize + " in all. Send a shorter one.");
  }
  return { turns, maxTokens: Math.min(wanted, room), count, dropped };
}

async function send(text) {
  const chat = chatId;
  const user = { role: "user", content: text, el: addMessage("user", text) };
  const out = addMessage("assistant", "");
  out.dataset.chunks = "0";
  out.dataset.done = "false";
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "generating…";
  let reply = "";
  let finish = null;
  let usage = null;
  let failed = false;
  let note = "";
  let sentAt = performance.now();
  let firstAt = null;
  let lastAt = null;
  try {
    const wanted = Number($("max-tokens").value) || 256;
    const fit = await fitToContext(user, wanted);
    const kept = new Set(fit.turns);
    for (const turn of history) {
      if (!kept.has(turn)) turn.el.classList.add("trimmed");
    }
    if (fit.dropped) note += "; left out " + fit.dropped + " older turn" + (fit.dropped > 1 ? "s" : "");
    if (fit.maxTokens < wanted) note += "; reply limited to " + fit.maxTokens + " tokens (context full)";
    const request = {
      model: modelName || undefined,
      messages: systemMessages().concat(fit.turns.map(({ role, content }) => ({ role, content }))),
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      max_tokens: fit.maxTokens,
    };
    if ($("seed").value !== "") request.seed = Number($("seed").value);
    window.lastRequest = request;
    sentAt = performance.now();
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorMessage(r));
    await readEvents(r.body, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices) {
        if (choice.delta && choice.delta.content) {
          const now = performance.now();
          if (firstAt === null) firstAt = now;
          lastAt = now;
          reply += choice.delta.content;
          out.textContent = reply;
          out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      return true;
    });
    $("status").textContent = "done" + (finish ? " (" + finish + ")" : "") + speed(usage, sentAt, firstAt, lastAt) + note;
  } catch (e) {
    if (e.name === "AbortError") {
      $("status").textContent = "stopped" + speed(usage, sentAt, firstAt, lastAt);
    } else {
      failed = true;
      out.className = "msg error";
      out.textContent = (reply ? reply + "\n" : "") + "Error: " + e.message;
      user.el.classList.add("failed");
      $("status").textContent = "error";
    }
  } finally {
    if (!failed && chat === chatId) {
      history.push(user);
      history.push({ role: "assistant", content: reply, el: out });
    }
    out.dataset.done = "true";
    out.dataset.finish = finish || "";
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// A rate needs enough tokens over enough time: chunks can arrive bunched (a few tokens within
// a millisecond), and over a short span that bunching is the whole measurement.
const RATE_MIN_TOKENS = 8; // tokens after the first
const RATE_MIN_MS = 250;

// ", N tokens, X tok/s": the decode rate, tokens after the first over the time from the first
// to the last. Too few tokens or too short a time for that: ", N tokens in T s" from the
// request to the last token.
function speed(usage, sentAt, firstAt, lastAt) {
  if (!usage || !usage.completion_tokens) return "";
  const n = usage.completion_tokens;
  let text = ", " + n + " token" + (n > 1 ? "s" : "");
  const span = firstAt !== null && lastAt !== null ? lastAt - firstAt : 0;
  if (n - 1 >= RATE_MIN_TOKENS && span >= RATE_MIN_MS) {
    return text + ", " + ((n - 1) / (span / 1000)).toFixed(1) + " tok/s";
  }
  if (lastAt !== null) text += " in " + ((lastAt - sentAt) / 1000).toFixed(2) + " s";
  return text;
}

function newChat() {
  if (controller) controller.abort();
  history = [];
  chatId += 1;
  window.lastRequest = null;
  $("log").replaceChildren();
  $("status").textContent = "new chat";
}

// Parse server-sent events out of a byte stream; calls onData for every `data:` payload.
async function readEvents(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder("utf-8");
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r\n\r\n|\n\n|\r\r/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^(\r\n\r\n|\n\n|\r\r)/, "");
      const data = block.split(/\r\n|\n|\r/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data && onData(data) === false) return;
    }
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", newChat);
$("api-key").addEventListener("change", loadModel);
loadModel();
