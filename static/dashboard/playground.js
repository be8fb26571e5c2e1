// The Playground page: sends a chat to the gateway's OpenAI endpoint (/v1/chat/completions, stream: true)
// with the key pasted in the page, and shows the answer as its server-sent events arrive (fetch and a
// ReadableStream: EventSource cannot POST), then the usage and the time to the first token. The key is
// only ever in this script's memory and the request to the gateway; the control plane never sees it.
"use strict";

(() => {
  const form = document.getElementById("playground");
  if (!form) return;
  const field = (id) => document.getElementById(id);
  const answer = field("pg-answer");
  const problem = field("pg-error");
  const stats = field("pg-stats");
  const send = field("pg-send");
  const stop = field("pg-stop");
  const gateway = form.dataset.gateway;
  let running = null; // the AbortController of the request in flight

  function number(id, label) {
    const value = Number(field(id).value);
    if (field(id).value.trim() === "" || !Number.isFinite(value)) throw new Error(`${label} must be a number.`);
    return value;
  }

  function body() {
    const message = field("pg-message").value;
    if (!message.trim()) throw new Error("Write a message first.");
    const messages = [];
    const system = field("pg-system").value;
    if (system.trim()) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: message });
    return {
      model: field("pg-model").value,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: number("pg-temperature", "Temperature"),
      top_p: number("pg-top-p", "Top p"),
      max_tokens: number("pg-max-tokens", "Max tokens"),
    };
  }

  // The message of an OpenAI error envelope, or the start of whatever else the gateway answered.
  async function refusal(response) {
    const text = await response.text();
    try {
      const message = JSON.parse(text).error.message;
      if (message) return `HTTP ${response.status}: ${message}`;
    } catch {
      // not an error envelope: show the text itself
    }
    return `HTTP ${response.status}: ${text.slice(0, 300) || response.statusText}`;
  }

  // Each complete event's data (the lines after "data:"), as they arrive; the rest waits for more bytes.
  async function* events(stream) {
    const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffered += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const event = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  }

  function say(usage, firstTokenMs, totalMs) {
    const parts = [];
    if (usage) parts.push(`${usage.prompt_tokens} prompt tokens, ${usage.completion_tokens} completion tokens`);
    if (firstTokenMs !== null) parts.push(`first token after ${Math.round(firstTokenMs)} ms`);
    parts.push(`${(totalMs / 1000).toFixed(2)} s in all`);
    stats.textContent = parts.join("; ") + ".";
  }

  async function chat() {
    answer.textContent = problem.textContent = stats.textContent = "";
    let request;
    try {
      request = body();
    } catch (error) {
      problem.textContent = error.message;
      return;
    }
    const key = field("pg-key").value.trim();
    if (!key) {
      problem.textContent = "Paste one of your API keys first.";
      return;
    }
    running = new AbortController();
    send.disabled = true;
    stop.hidden = false;
    const started = performance.now();
    let firstTokenMs = null;
    let usage = null;
    try {
      let response;
      try {
        response = await fetch(`${gateway}/v1/chat/completions`, {
          method: "POST",
          headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
          body: JSON.stringify(request),
          signal: running.signal,
        });
      } catch (error) {
        if (error.name === "AbortError") throw error;
        throw new Error(
          `Could not reach the gateway at ${gateway}: it is down, or it does not let this page's address ` +
            `(${location.origin}) call it (CORS). ${error.message}`,
        );
      }
      if (!response.ok) throw new Error(await refusal(response));
      for await (const data of events(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the gateway ended the stream with an error");
        if (chunk.usage) usage = chunk.usage;
        const text = chunk.choices && chunk.choices[0] && chunk.choices[0].delta && chunk.choices[0].delta.content;
        if (text) {
          if (firstTokenMs === null) firstTokenMs = performance.now() - started;
          answer.append(text);
        }
      }
      say(usage, firstTokenMs, performance.now() - started);
    } catch (error) {
      problem.textContent = error.name === "AbortError" ? "Stopped." : error.message;
    } finally {
      running = null;
      send.disabled = false;
      stop.hidden = true;
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (!running) chat();
  });
  stop.addEventListener("click", () => running && running.abort());
})();
