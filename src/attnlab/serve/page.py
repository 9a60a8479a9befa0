"""The web page at ``/`` of ``attnlab serve``: a streaming chat box, a translate box with the
attention heatmap of the translation, a model picker. One self-contained HTML file (no CDN, no
build step): it only talks to the server's own routes."""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attnlab serve</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:15px/1.4 system-ui,sans-serif;margin:0 auto;max-width:980px;padding:1em;color:#222}
 h1{font-size:1.3em} h2{font-size:1.1em;margin:.2em 0} section{border:1px solid #ddd;border-radius:6px;padding:1em;margin:1em 0}
 textarea,input[type=text]{width:100%;box-sizing:border-box;font:inherit;padding:.4em}
 #log{white-space:pre-wrap;min-height:4em;max-height:24em;overflow:auto;background:#fafafa;padding:.5em;border-radius:4px}
 .user{color:#05a}.assistant{color:#222}.err{color:#b00}
 .row{display:flex;gap:.5em;align-items:center;margin:.4em 0;flex-wrap:wrap}
 table.heat{border-collapse:collapse;font-size:12px;margin-top:.5em} table.heat td{width:22px;height:22px;border:1px solid #fff}
 table.heat th{font-weight:normal;padding:0 4px;white-space:nowrap} table.heat thead th{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left}
 #hover{min-height:1.4em;font-family:monospace}
 [hidden]{display:none!important} /* else .row's display:flex shows the hidden #pickers */
</style></head><body>
<h1>attnlab serve</h1>
<section id="chat"><h2>Chat</h2>
 <div class="row">model <select id="chatModel"></select> max tokens <input id="maxTok" type="number" value="128" min="1" style="width:6em">
  temperature <input id="temp" type="number" value="0" min="0" max="2" step="0.1" style="width:5em">
  <button id="clear">clear</button></div>
 <div id="log"></div>
 <div class="row"><textarea id="msg" rows="2" placeholder="Say something (Enter sends, Shift+Enter a new line)"></textarea></div>
 <div class="row"><button id="send">send</button><span id="chatStatus"></span></div>
</section>
<section id="mt"><h2>Translate</h2>
 <div class="row">model <select id="mtModel"></select> beam <input id="beam" type="number" value="4" min="1" max="16" style="width:4em"></div>
 <input id="src" type="text" placeholder="A sentence to translate">
 <div class="row"><button id="go">translate</button><strong id="out"></strong></div>
 <div class="row" id="pickers" hidden>attention <select id="kind"><option value="cross">cross (target → source)</option>
  <option value="encoder">encoder self</option><option value="decoder">decoder self</option></select>
  layer <select id="layer"></select> head <select id="head"></select></div>
 <div id="hover"></div><div id="heat"></div>
</section>
<script>
const $ = id => document.getElementById(id);
let history = [], maps = null, contexts = {};
async function api(path, body) {
  const r = await fetch(path, body === undefined ? {} : {method: "POST", headers: {"content-type": "application/json"}, body: JSON.stringify(body)});
  const j = await r.json();
  if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
  return j;
}
function fill(sel, items) { sel.innerHTML = ""; for (const [v, t] of items) { const o = document.createElement("option"); o.value = v; o.textContent = t; sel.appendChild(o); } }
async function models() {
  const list = (await api("/v1/models")).data;
  const lms = list.filter(m => m.kind === "lm"), mts = list.filter(m => m.kind === "translation");
  fill($("chatModel"), lms.map(m => [m.id, m.id])); fill($("mtModel"), mts.map(m => [m.id, m.id]));
  for (const m of list) contexts[m.id] = m.context_length;
  fitMaxTokens();
  $("chat").hidden = !lms.length; $("mt").hidden = !mts.length;
}
function line(cls, text) { const d = document.createElement("div"); d.className = cls; d.textContent = text; $("log").appendChild(d); $("log").scrollTop = 1e9; return d; }
function fitMaxTokens() {  // a budget past the model's context would only get a 400
  const ctx = contexts[$("chatModel").value]; if (ctx && +$("maxTok").value >= ctx) $("maxTok").value = Math.floor(ctx / 2);
}
async function send() {
  const text = $("msg").value.trim(); if (!text || $("send").disabled) return;  // one reply at a time
  $("msg").value = ""; history.push({role: "user", content: text}); line("user", "you: " + text);
  const out = line("assistant", ""); let reply = ""; $("send").disabled = true; $("chatStatus").textContent = "…";
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"content-type": "application/json"},
      body: JSON.stringify({model: $("chatModel").value, messages: history, stream: true,
                            max_tokens: +$("maxTok").value, temperature: +$("temp").value})});
    if (!r.ok) { const j = await r.json(); throw new Error(j.error ? j.error.message : r.statusText); }
    const reader = r.body.getReader(), dec = new TextDecoder(); let buf = "";
    for (;;) {
      const {value, done} = await reader.read(); if (done) break;
      buf += dec.decode(value, {stream: true}); const parts = buf.split("\n\n"); buf = parts.pop();
      for (const p of parts) {
        if (!p.startsWith("data: ")) continue; const data = p.slice(6); if (data === "[DONE]") continue;
        const c = JSON.parse(data); if (c.error) throw new Error(c.error.message);
        for (const ch of c.choices) { if (ch.delta && ch.delta.content) { reply += ch.delta.content; out.textContent = reply; }
                                      if (ch.finish_reason) $("chatStatus").textContent = "finished: " + ch.finish_reason; }
      }
    }
    history.push({role: "assistant", content: reply});
  } catch (e) { if (!reply && out.remove) out.remove(); line("err", "error: " + e.message); history.pop(); }
  $("send").disabled = false;
}
async function translate() {
  const text = $("src").value.trim(); if (!text) return;
  $("out").textContent = "…"; $("heat").innerHTML = ""; $("pickers").hidden = true;
  try {
    const model = $("mtModel").value;
    maps = await api("/v1/attention", {model, text, beam: +$("beam").value});
    $("out").textContent = maps.translation; $("pickers").hidden = false; layers(); draw();
  } catch (e) { $("out").textContent = "error: " + e.message; }
}
function layers() {
  const m = maps[$("kind").value]; fill($("layer"), m.map((_, i) => [i, i + 1]));
  fill($("head"), [["mean", "mean"], ...m[0].map((_, i) => [i, i + 1])]);
}
function draw() {
  const kind = $("kind").value, w = maps[kind][+$("layer").value], h = $("head").value;
  const q = kind === "encoder" ? maps.src_tokens : maps.tgt_in_tokens, k = kind === "decoder" ? maps.tgt_in_tokens : maps.src_tokens;
  const grid = h === "mean" ? w[0].map((row, i) => row.map((_, j) => w.reduce((s, hd) => s + hd[i][j], 0) / w.length)) : w[+h];
  const t = document.createElement("table"); t.className = "heat";
  const head = t.createTHead().insertRow(); head.appendChild(document.createElement("th"));
  for (const tok of k) { const th = document.createElement("th"); th.textContent = tok; head.appendChild(th); }
  const body = t.createTBody();
  grid.forEach((row, i) => { const tr = body.insertRow(); const th = document.createElement("th"); th.textContent = q[i]; tr.appendChild(th);
    row.forEach((v, j) => { const td = tr.insertCell(); td.style.background = `rgba(20,80,200,${v})`;
      td.onmouseenter = () => { $("hover").textContent = `${q[i]} → ${k[j]}: ${v.toFixed(3)}`; }; }); });
  $("heat").innerHTML = ""; $("heat").appendChild(t); $("hover").textContent = "";
}
$("send").onclick = send; $("go").onclick = translate; $("clear").onclick = () => { history = []; $("log").innerHTML = ""; };
$("msg").onkeydown = e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } };
$("src").onkeydown = e => { if (e.key === "Enter") translate(); };
$("chatModel").onchange = fitMaxTokens; $("kind").onchange = () => { layers(); draw(); }; $("layer").onchange = draw; $("head").onchange = draw;
models().catch(e => line("err", "error: " + e.message));
</script></body></html>
"""
