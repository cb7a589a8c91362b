//! The `/debug/` page: actors, their mailboxes and recent messages, endpoints, policies, nodes
//! (routing mode, masquerade, routes) and Services (counts, frontends and backends),
//! refreshing itself every two seconds from the JSON endpoints.

use actix_web::HttpResponse;

pub async fn page() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(PAGE)
}

const PAGE: &str = r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ciliate agent</title>
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
 h1{font-size:1.4em;margin:0 0 .2em} h2{font-size:1.1em;margin:1.4em 0 .4em}
 table{border-collapse:collapse;width:100%;background:#fff} td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
 th{background:#eef} tr.sel{background:#ffd} tr.click{cursor:pointer} .err{color:#b00} .ok{color:#070} .muted{color:#888}
 .grid{display:grid;grid-template-columns:1fr 1fr;gap:1.5em} code{font-size:12px}
</style></head><body>
<h1>ciliate agent</h1><div id="hdr" class="muted">loading…</div>
<div class="grid"><div>
<h2>Actors</h2><table id="actors"><thead><tr><th>actor</th><th>mailbox</th><th>handled</th><th>last message</th><th>p50 µs</th><th>p99 µs</th></tr></thead><tbody></tbody></table>
</div><div>
<h2>Recent messages of <span id="selname">PolicyRepoActor</span></h2>
<table id="msgs"><thead><tr><th>#</th><th>message</th><th>summary</th><th>from</th><th>took µs</th><th>outcome</th></tr></thead><tbody></tbody></table>
</div></div>
<h2>Endpoints</h2><table id="eps"><thead><tr><th>id</th><th>name</th><th>identity</th><th>state</th><th>revision</th><th>entries</th><th>ips</th><th>error</th></tr></thead><tbody></tbody></table>
<h2>Policies</h2><table id="pols"><thead><tr><th>kind</th><th>name</th><th>rules</th><th>revision</th><th>status</th><th>notes</th></tr></thead><tbody></tbody></table>
<h2>Start-up <span id="startup" class="muted"></span></h2>
<h2>Nodes <span id="routing" class="muted"></span></h2><table id="nodes"><thead><tr><th>name</th><th>local</th><th>ips</th><th>pod CIDRs</th><th>route</th></tr></thead><tbody></tbody></table>
<h2>Services <span id="svccounts" class="muted"></span></h2><table id="svcs"><thead><tr><th>service</th><th>frontend</th><th>backends</th></tr></thead><tbody></tbody></table>
<script>
let sel = "PolicyRepoActor";
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
// RFC 3339 with microseconds: Date.parse keeps milliseconds, the last three digits are added here.
const micros = t => Date.parse(t) * 1000 + (parseInt(t.slice(23, 26), 10) || 0);
const fill = (id, rows) => { document.querySelector("#"+id+" tbody").innerHTML = rows.join(""); };
async function get(p){ const r = await fetch(p); if(!r.ok) throw new Error(p+": "+r.status); return r.json(); }
async function refresh(){
 try {
  const [actors, eps, pol] = await Promise.all([get("/debug/actors"), get("/debug/endpoints"), get("/debug/policy")]);
  const ready = (await fetch("/readyz")).ok;
  document.getElementById("hdr").innerHTML = `policy revision <b>${pol.revision}</b> · ${eps.length} endpoints · ${pol.policies.length} policies · ${ready ? '<span class=ok>ready</span>' : '<span class=err>not ready</span>'} · refreshed ${new Date().toLocaleTimeString()}`;
  fill("actors", actors.map(a => `<tr class="click ${a.name===sel?'sel':''}" onclick="sel='${esc(a.name)}';refresh()"><td>${esc(a.name)}</td><td>${a.mailbox}</td><td>${a.handled}</td><td>${esc(a.last_message)}</td><td>${a.handle_p50_us}</td><td>${a.handle_p99_us}</td></tr>`));
  document.getElementById("selname").textContent = sel;
  const msgs = await get("/debug/actors/" + sel.replace("/", "%2F") + "/messages").catch(() => []);
  fill("msgs", msgs.slice(-40).reverse().map(m => `<tr><td>${m.seq}</td><td>${esc(m.message)}</td><td><code>${esc(m.summary)}</code></td><td>${esc(m.from)}</td><td>${micros(m.finished_at) - micros(m.started_at)}</td><td class="${m.outcome==='ok'?'ok':'err'}">${esc(m.outcome)}</td></tr>`));
  fill("eps", eps.map(e => `<tr><td>${e.id}</td><td>${esc(e.name)}</td><td>${e.identity ?? ""}</td><td class="${e.state==='ready'?'ok':'err'}">${esc(e.state)}</td><td>${e.policy_revision}</td><td>${e.policy_entries}</td><td>${esc(e.ips.join(", "))}</td><td class=err>${esc(e.error)}</td></tr>`));
  const net = await get("/debug/nodes").catch(() => ({mode: "?", routes_installed: 0, nodes: []}));
  const startup = await get("/debug/startup").catch(() => []);
  document.getElementById("startup").textContent = startup.map(p => `${p.scope} ${(p.seconds * 1000).toFixed(1)} ms`).join(" · ");
  document.getElementById("routing").textContent = `routing ${net.mode} · ${net.routes_installed} routes installed · masquerade ${net.masquerade || "?"} · host routing ${net.host_routing || "?"}`;
  fill("nodes", net.nodes.map(n => `<tr><td>${esc(n.name)}</td><td>${n.local ? "yes" : ""}</td><td>${esc(n.ips.join(", "))}</td><td>${esc(n.pod_cidrs.join(", "))}</td><td class="${n.route.startsWith('error')?'err':'ok'}">${esc(n.route)}</td></tr>`));
  const lb = await get("/debug/services").catch(() => ({counts: {}, frontends: []}));
  const [c, svcs] = [lb.counts, lb.frontends];
  document.getElementById("svccounts").textContent = `${c.services ?? "?"} services · ${c.frontends ?? "?"} frontends · ${c.backends ?? "?"} backends · translation ${c.translation || "?"}`;
  fill("svcs", svcs.map(f => `<tr><td>${esc(f.namespace + "/" + f.name)}</td><td>${esc(f.frontend)}</td><td>${f.backends.length ? esc(f.backends.map(b => b.ip + ":" + b.port + (b.ready ? "" : " (not ready)")).join(", ")) : '<span class=err>none: connections are refused</span>'}</td></tr>`));
  fill("pols", pol.policies.map(p => `<tr><td>${esc(p.kind)}</td><td>${esc((p.namespace ? p.namespace + "/" : "") + p.name)}</td><td>${p.rules}</td><td>${p.revision}</td><td class="${p.status==='accepted'?'ok':'err'}">${esc(p.status)}</td><td>${esc(p.notes.join("; "))}</td></tr>`));
 } catch(e) { document.getElementById("hdr").innerHTML = `<span class=err>${esc(e.message)}</span>`; }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>"##;
