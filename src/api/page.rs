//! The `/debug/` page: actors, their mailboxes and recent messages, recent flows with their
//! deciding policies (filterable by namespace and verdict), policy changes drawn as waterfalls
//! through the actors, endpoints, policies with their hits, nodes (routing mode, masquerade,
//! routes), Services (counts, frontends and backends) and the DNS proxy with the FQDN cache,
//! refreshing itself every two seconds
//! from the JSON endpoints.

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
 .fwd{color:#070} .drop{color:#b00;font-weight:600} .audit{color:#a60;font-weight:600}
 .wf{position:relative;height:14px;min-width:240px;background:#f3f3f3} .wf span{position:absolute;top:2px;height:10px}
 .wait{background:#ccc} .run{background:#36c} select,input{font:inherit}
</style></head><body>
<h1>ciliate agent</h1><div id="hdr" class="muted">loading…</div>
<div class="grid"><div>
<h2>Actors</h2><table id="actors"><thead><tr><th>actor</th><th>mailbox</th><th>handled</th><th>last message</th><th>p50 µs</th><th>p99 µs</th></tr></thead><tbody></tbody></table>
</div><div>
<h2>Recent messages of <span id="selname">PolicyRepoActor</span></h2>
<table id="msgs"><thead><tr><th>#</th><th>message</th><th>summary</th><th>from</th><th>took µs</th><th>outcome</th></tr></thead><tbody></tbody></table>
</div></div>
<h2>Flows <span class="muted">recent verdicts and the policies that decided them</span></h2>
<div>namespace <input id="flowns" size="12" placeholder="any"> verdict <select id="flowverdict"><option value="">any</option><option>forwarded</option><option>dropped</option><option>audit</option></select> <span id="flowcount" class="muted"></span></div>
<table id="flows"><thead><tr><th>time</th><th>source</th><th>destination</th><th>port</th><th>verdict</th><th>why</th><th>staged</th></tr></thead><tbody></tbody></table>
<h2>Changes <span class="muted">one change through the actors: mailbox wait (grey) and handling (blue), to the map write</span></h2>
<div><select id="changesel"></select> <span id="changeinfo" class="muted"></span></div>
<table id="waterfall"><thead><tr><th>actor</th><th>message</th><th>summary</th><th>wait µs</th><th>took µs</th><th>timeline</th></tr></thead><tbody></tbody></table>
<h2>Endpoints</h2><table id="eps"><thead><tr><th>id</th><th>name</th><th>identity</th><th>state</th><th>revision</th><th>entries</th><th>ips</th><th>error</th></tr></thead><tbody></tbody></table>
<h2>Policies</h2><table id="pols"><thead><tr><th>kind</th><th>name</th><th>rules</th><th>revision</th><th>status</th><th>forwarded</th><th>dropped</th><th>audit</th><th>notes</th></tr></thead><tbody></tbody></table>
<h2>Start-up <span id="startup" class="muted"></span></h2>
<h2>Nodes <span id="routing" class="muted"></span></h2><table id="nodes"><thead><tr><th>name</th><th>local</th><th>ips</th><th>pod CIDRs</th><th>route</th></tr></thead><tbody></tbody></table>
<h2>Services <span id="svccounts" class="muted"></span></h2><table id="svcs"><thead><tr><th>service</th><th>frontend</th><th>backends</th></tr></thead><tbody></tbody></table>
<h2>DNS proxy <span id="dnsproxy" class="muted"></span></h2><table id="fqdn"><thead><tr><th>name</th><th>ips</th><th>expires</th><th>endpoints</th></tr></thead><tbody></tbody></table>
<h2>HTTP proxy: L7 flows <span id="httpproxy" class="muted"></span></h2><table id="l7"><thead><tr><th>time</th><th>verdict</th><th>direction</th><th>from</th><th>to</th><th>request</th><th>code</th><th>added</th><th>rule</th></tr></thead><tbody></tbody></table>
<script>
let sel = "PolicyRepoActor", change = null;
const pod = (ip, name) => name ? `${esc(name)} <span class=muted>${esc(ip)}</span>` : esc(ip);
async function flows(){
 const v = document.getElementById("flowverdict").value, ns = document.getElementById("flowns").value.trim();
 const all = await get("/debug/flows?limit=2000" + (v ? "&verdict=" + v : "")).catch(() => []);
 const inNs = f => !ns || [f.source_pod, f.destination_pod].some(p => p && p.startsWith(ns + "/"));
 const shown = all.filter(f => f.type !== "lost" && inNs(f)).slice(-100).reverse();
 document.getElementById("flowcount").textContent = `${shown.length} shown of ${all.length} kept`;
 fill("flows", shown.map(f => `<tr><td>${esc((f.time || "").slice(11, 23))}</td><td>${pod(f.source, f.source_pod)}</td><td>${pod(f.destination, f.destination_pod)}</td><td>${esc(f.protocol)}/${f.port}</td><td class="${f.verdict === 'forwarded' ? 'fwd' : f.verdict === 'audit' ? 'audit' : 'drop'}">${esc(f.verdict)}</td><td class="why">${esc(f.why || f.reason)}</td><td>${f.staged ? `<span class="${f.staged.verdict === 'forwarded' ? 'fwd' : 'drop'}">${esc(f.staged.verdict)}</span> ${(f.staged.policies || []).map(p => esc((p.namespace ? p.namespace + "/" : "") + p.name + (p.rule != null ? `[${p.rule}]` : ""))).join(", ")}` : ""}</td></tr>`));
}
async function changes(){
 const list = await get("/debug/changes").catch(() => []);
 const sel = document.getElementById("changesel");
 if (change === null || !list.some(c => c.id === change)) { const c = list.find(c => c.messages > 0); change = c ? c.id : null; }
 sel.innerHTML = list.map(c => `<option value="${c.id}" ${c.id === change ? "selected" : ""}>#${c.id} ${esc(c.cause)} · ${c.messages} messages · ${(c.took_us / 1000).toFixed(1)} ms</option>`).join("");
 if (change === null) { fill("waterfall", []); return; }
 const c = await get("/debug/changes/" + change).catch(() => null);
 if (!c) return;
 const t0 = Math.min(...c.steps.map(s => micros(s.enqueued_at))), t1 = Math.max(...c.steps.map(s => micros(s.finished_at)));
 const span = Math.max(t1 - t0, 1), pct = t => ((t - t0) * 100 / span).toFixed(2);
 document.getElementById("changeinfo").textContent = `${c.cause} · ${c.steps.length} messages · ${((t1 - t0) / 1000).toFixed(2)} ms from the first send to the last map write`;
 fill("waterfall", c.steps.map(s => { const [e, b, f] = [micros(s.enqueued_at), micros(s.started_at), micros(s.finished_at)];
  return `<tr><td>${esc(s.actor)}</td><td>${esc(s.message)}</td><td><code>${esc(s.summary)}</code></td><td>${s.wait_us}</td><td>${s.handle_us}</td><td><div class="wf"><span class="wait" style="left:${pct(e)}%;width:${pct(b) - pct(e)}%"></span><span class="run" style="left:${pct(b)}%;width:${Math.max(pct(f) - pct(b), 0.3)}%"></span></div></td></tr>`; }));
}
document.addEventListener("change", e => { if (e.target.id === "changesel") { change = Number(e.target.value); changes(); } else flows(); });
document.addEventListener("input", e => { if (e.target.id === "flowns") flows(); });
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
  document.getElementById("routing").textContent = `routing ${net.mode} · ${net.routes_installed} routes installed · masquerade ${net.masquerade || "?"}${net.masquerade_ipv6 ? " · IPv6 masquerade " + net.masquerade_ipv6 : ""} · host routing ${net.host_routing || "?"}${net.tunnel ? " · tunnel " + net.tunnel : ""} · host firewall ${net.host_firewall_device || "off"}`;
  fill("nodes", net.nodes.map(n => `<tr><td>${esc(n.name)}</td><td>${n.local ? "yes" : ""}</td><td>${esc(n.ips.join(", "))}</td><td>${esc(n.pod_cidrs.join(", "))}</td><td class="${n.route.startsWith('error')?'err':'ok'}">${esc(n.route)}</td></tr>`));
  const lb = await get("/debug/services").catch(() => ({counts: {}, frontends: []}));
  const [c, svcs] = [lb.counts, lb.frontends];
  document.getElementById("svccounts").textContent = `${c.services ?? "?"} services · ${c.frontends ?? "?"} frontends · ${c.backends ?? "?"} backends · translation ${c.translation || "?"}`;
  fill("svcs", svcs.map(f => `<tr><td>${esc(f.namespace + "/" + f.name)}</td><td>${esc(f.frontend)}</td><td>${f.backends.length ? esc(f.backends.map(b => b.ip + ":" + b.port + (b.ready ? "" : " (not ready)")).join(", ")) : '<span class=err>none: connections are refused</span>'}</td></tr>`));
  fill("pols", pol.policies.map(p => `<tr><td>${esc(p.kind)}</td><td>${esc((p.namespace ? p.namespace + "/" : "") + p.name)}</td><td>${p.rules}</td><td>${p.revision}</td><td class="${p.status==='accepted'?'ok':'err'}">${esc(p.status)}</td><td>${p.hits.forwarded}</td><td>${p.hits.dropped}</td><td>${p.hits.audit}</td><td>${esc(p.notes.join("; "))}</td></tr>`));
  const dns = await get("/debug/dns").catch(() => ({proxy: {}, cache: []}));
  const px = dns.proxy;
  document.getElementById("dnsproxy").innerHTML = `mode ${esc(px.mode || "?")} · ${px.connected ? `<span class=ok>connected</span> (pid ${px.pid}, udp ${px.udp_port}, tcp ${px.tcp_port})` : `<span class=err>not connected</span> ${esc(px.error)}`} · ${dns.endpoints_with_dns_rules ?? 0} endpoints with DNS rules · ${dns.cache.length} names`;
  fill("fqdn", dns.cache.slice(0, 200).map(n => `<tr><td>${esc(n.name)}</td><td>${esc(n.ips.join(", "))}</td><td>${esc(new Date(n.expires_at * 1000).toLocaleString())}</td><td>${esc(n.endpoints.join(", "))}</td></tr>`));
  const http = await get("/debug/http").catch(() => ({proxy: {}, flows: []}));
  const hp = http.proxy;
  document.getElementById("httpproxy").innerHTML = `mode ${esc(hp.mode || "?")} · ${hp.connected ? `<span class=ok>connected</span> (pid ${hp.pid}, egress ${hp.egress_port}, ingress ${hp.ingress_port}${hp.holds ? `; ${hp.holds.connections} client connections, ${hp.holds.parked} parked, ${hp.holds.upstream_idle} idle upstream` : ""})` : `<span class=err>not connected</span> ${esc(hp.error)}`} · ${http.endpoints_with_l7_rules ?? 0} endpoints with L7 rules`;
  const rule = p => p ? esc((p.namespace ? p.namespace + "/" : "") + p.name + (p.rule != null ? `[${p.rule}]` : "") + (p.http != null ? ` http[${p.http}]` : "")) : "";
  fill("l7", (http.flows || []).map(f => `<tr><td>${esc(new Date(f.timestamp_ns / 1e6).toLocaleTimeString())}</td><td class="${f.verdict==='dropped'?'err':'ok'}">${esc(f.verdict)}</td><td>${esc(f.direction)}</td><td>${esc(f.source_pod || f.source)}</td><td>${esc(f.destination_pod || f.destination)}:${f.port}</td><td>${esc(f.http.method + " " + f.http.url)}</td><td>${f.http.code}</td><td>${Math.round(f.latency_ns / 1000)} µs</td><td>${(f.policies || []).map(rule).join(", ")}</td></tr>`));
  await flows(); await changes();
 } catch(e) { document.getElementById("hdr").innerHTML = `<span class=err>${esc(e.message)}</span>`; }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>"##;
