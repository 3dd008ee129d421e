// Colibri's chat page: plain JavaScript, no build step. Streams tokens from
// /v1/chat/completions (server-sent events read with fetch) and shows them as they come.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];
let controller = null;
let modelName = null;

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

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    modelName = body.data[0].id;
    $("model").textContent = modelName;
  } catch (e) {
    $("model").textContent = "model unavailable: " + e.message;
    setTimeout(loadModel, 2000);
  }
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

async function send(text) {
  const system = $("system").value.trim();
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.chunks = "0";
  out.dataset.done = "false";
  const request = {
    model: modelName || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value) || undefined,
  };
  if ($("seed").value !== "") request.seed = Number($("seed").value);
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "generating…";
  let reply = "";
  let finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : r.status + " " + r.statusText);
    }
    await readEvents(r.body, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices) {
        if (choice.delta && choice.delta.content) {
          reply += choice.delta.content;
          out.textContent = reply;
          out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      return true;
    });
    $("status").textContent = "done" + (finish ? " (" + finish + ")" : "");
  } catch (e) {
    if (e.name === "AbortError") {
      $("status").textContent = "stopped";
    } else {
      out.className = "msg error";
      out.textContent = (reply ? reply + "\n" : "") + "Error: " + e.message;
      $("status").textContent = "error";
    }
  } finally {
    history.push({ role: "assistant", content: reply });
    out.dataset.done = "true";
    out.dataset.finish = finish || "";
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
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
$("api-key").addEventListener("change", loadModel);
loadModel();
