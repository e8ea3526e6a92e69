// Alnair's dashboard: reads the brain's HTTP API with the caller's token and draws the
// cluster. Plain JavaScript, no dependencies. Data is put in the page with textContent
// only, never as HTML, so nothing a job is named can run in the browser.
"use strict";

const REFRESH_MS = 2000;
const NODES_SHOWN = 256;
const MAX_EVENTS = 100;
const TOKEN_KEY = "alnair-token";

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "style") node.style.cssText = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// -- the token -------------------------------------------------------------------------
// `#token=...` in the address (what `alnair up` prints) is kept for this tab only and
// taken out of the address bar; a fragment is never sent to the server.

function takeTokenFromAddress() {
  const match = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

class Unauthorized extends Error {}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY) || "";
  const response = await fetch(path, { headers: { Authorization: `Bearer ${token}` } });
  if (response.status === 401) throw new Unauthorized("the token was refused");
  const body = await response.json();
  if (!response.ok) throw new Error(`${path}: ${body.error || response.status}`);
  return body;
}

function askForToken(message) {
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  start();
});

// -- drawing ---------------------------------------------------------------------------

function heat(util) {
  // Idle is a cold blue, saturated a hot red.
  const u = Math.max(0, Math.min(100, util)) / 100;
  return `hsl(${Math.round(220 - 220 * u)}, 70%, ${Math.round(28 + 17 * u)}%)`;
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return `${s}s`;
  if (s < 5400) return `${Math.round(s / 60)}m`;
  return `${(s / 3600).toFixed(1)}h`;
}

function mib(value) {
  return value >= 1024 ? `${(value / 1024).toFixed(1)} GiB` : `${Math.round(value)} MiB`;
}

function drawLegend() {
  const legend = $("legend");
  legend.replaceChildren(el("span", {}, "0%\u00a0"));
  for (let u = 0; u <= 100; u += 10) {
    legend.append(el("span", { class: "swatch", style: `background:${heat(u)}` }));
  }
  legend.append(el("span", {}, "\u00a0100%"));
}

// `of`: how many nodes there are when `nodes` is only the first page of them (else null).
function drawNodes(nodes, holders, of) {
  const box = $("nodes");
  if (!nodes.length) {
    box.replaceChildren(el("p", { class: "muted" }, "no node has joined yet"));
    return;
  }
  const tiles = nodes.map((status) => {
    const record = status.record;
    const latest = new Map(status.latest.map((sample) => [sample.index, sample]));
    const held = new Set(status.allocated_gpus);
    const drained = new Set((record.drained_gpus || []).map((d) => d.index));
    const shared = new Map((status.shares || []).map((s) => [s.index, s]));
    const cells = record.gpus.map((gpu) => {
      const sample = latest.get(gpu.index);
      const util = sample ? sample.util_gpu_pct : 0;
      const share = shared.get(gpu.index);
      // A shareable job holds its GPU whole beside its guests' shares: both are named.
      const host = holders.get(`${record.name}/${gpu.index}`);
      const guests = share
        ? share.jobs.map((u) => `${u.job_id} ${u.gpu_milli / 1000}`).join(", ")
        : null;
      const job = [host, guests].filter(Boolean).join(", ");
      const sick = gpu.health !== "healthy" || drained.has(gpu.index);
      const title =
        `${record.name} GPU ${gpu.index} ${gpu.model}\n` +
        (sample
          ? `util ${util}%  memory ${mib(sample.mem_used_mib)} / ${mib(sample.mem_total_mib)}` +
            `  ${sample.power_w} W  ${sample.temp_c} °C`
          : "no telemetry") +
        (job ? `\njob ${job}` : "") +
        (share ? `\n${shareText(share)}` : "") +
        (sick ? `\n${gpu.health_reason || "drained"}` : "");
      return el(
        "div",
        {
          class: `gpu-cell${held.has(gpu.index) ? " held" : ""}${sick ? " sick" : ""}`,
          style: `background:${sample ? heat(util) : "#333"}`,
          title,
          "data-node": record.name,
          "data-gpu": String(gpu.index),
        },
        el("span", {}, sample ? `${Math.round(util)}%` : "–"),
        job ? el("span", { class: "job" }, `job ${job}`) : null,
      );
    });
    const model = record.gpus.length ? record.gpus[0].model : "";
    return el(
      "div",
      { class: "node" },
      el(
        "div",
        { class: "node-name" },
        el("strong", {}, record.name),
        el("span", { class: `state ${record.state}` }, record.state),
        el("div", { class: "muted small" }, `${model} · seen ${ago(status.last_seen_s_ago)} ago`),
      ),
      el("div", { class: "gpus" }, ...cells),
    );
  });
  if (of !== null) {
    const note = `the first ${nodes.length} of ${of} nodes, by name (alnair nodes lists every one)`;
    tiles.push(el("p", { class: "muted" }, note));
  }
  box.replaceChildren(...tiles);
}

// A shared GPU: each job's share, GPU memory limit and use, and who enforces them.
function shareText(share) {
  const jobs = share.jobs.map(
    (u) =>
      `${u.job_id}: ${u.gpu_milli / 1000} of the GPU, limit ` +
      (u.memory_limit_mib == null ? "none" : mib(u.memory_limit_mib)) +
      (u.memory_used_mib == null ? "" : `, uses ${mib(u.memory_used_mib)}`),
  );
  const how = share.enforcement === "mps" ? "enforced by MPS" : "accounted, not enforced";
  return `shared (${how}${share.mps_problem ? `: ${share.mps_problem}` : ""})\n${jobs.join("\n")}`;
}

function grantsText(job) {
  // An elastic job that shrank off a node keeps its idle worker host there.
  return job.grants.map((g) => `${g.node}[${g.gpus.join(",") || "idle"}]`).join(" ") || "-";
}

// GPUs held; an elastic job's range, and the size an operator pinned it at.
function sizeText(job) {
  if (job.spec.gpu_milli != null) return `${job.spec.gpu_milli / 1000} of a GPU`;
  const held = job.grants.reduce((n, g) => n + g.gpus.length, 0);
  if (!job.spec.elastic) return `${held}`;
  const pin = job.pinned_gpus == null ? "" : ` pinned ${job.pinned_gpus}`;
  return `${held} [${job.spec.min_gpus ?? 1}..${job.spec.max_gpus ?? job.spec.gpus}]${pin}`;
}

function drawQueue(pending, now) {
  $("queue-count").textContent = `(${pending.length} pending)`;
  const rows = pending.map((job) =>
    el(
      "tr",
      { "data-job": job.job_id },
      el("td", {}, job.job_id),
      el("td", {}, job.spec.name),
      el("td", {}, job.tenant),
      el("td", {}, job.spec.queue),
      el("td", {}, job.spec.gpu_milli != null ? job.spec.gpu_milli / 1000 : job.spec.gpus),
      el("td", {}, ago(now - job.submitted_at)),
      el("td", { class: "reason" }, job.reason || ""),
    ),
  );
  $("queue").tBodies[0].replaceChildren(...rows);
}

// Shown once queues are configured (alnair brain --queues): GPUs held beyond the
// guarantee are borrowed, and preemptible for a queue owed its own. A share of a GPU
// counts as its share.
function drawQueues(queues) {
  $("queues-section").hidden = !queues.some((q) => q.listed);
  const rows = queues.map((q) =>
    el(
      "tr",
      { "data-queue": q.name },
      el("td", {}, q.listed ? q.name : `${q.name} (not listed)`),
      el("td", {}, q.job_class),
      el("td", {}, q.guaranteed_gpus),
      el("td", {}, q.running_jobs),
      el("td", {}, q.running_gpus),
      // In thousandths, as shares are asked (0.25): no binary-fraction tails.
      el("td", {}, Math.max(0, Math.round((q.running_gpus - q.guaranteed_gpus) * 1000) / 1000)),
      el("td", {}, q.pending_jobs),
      el("td", {}, q.pending_gpus),
    ),
  );
  $("queues").tBodies[0].replaceChildren(...rows);
}

function drawRunning(running, profiles) {
  $("running-count").textContent = `(${running.length})`;
  const rows = running.map((job) => {
    const p = profiles.get(job.job_id);
    const pct = (v) => (p ? `${v.toFixed(0)}%` : "…");
    return el(
      "tr",
      { "data-job": job.job_id },
      el("td", {}, job.job_id),
      el("td", {}, job.spec.name),
      el("td", {}, job.tenant),
      el("td", {}, sizeText(job)),
      el("td", {}, grantsText(job)),
      el("td", {}, p ? pct(p.mean_util_pct) : "…"),
      el("td", {}, p ? pct(p.p95_util_pct) : "…"),
      el("td", {}, p ? mib(p.mem_peak_mib) : "…"),
      el("td", {}, p && p.period_s ? `${p.period_s.toFixed(1)}s` : "-"),
      el(
        "td",
        {},
        p ? `${p.forecast_util_pct.toFixed(0)}% · ${mib(p.forecast_mem_mib)} next ${ago(p.horizon_s)}` : "…",
      ),
      el(
        "td",
        {},
        p && p.underused ? el("span", { class: "badge" }, `underused: ${p.idle_gpus} idle GPU(s)`) : null,
      ),
    );
  });
  $("running").tBodies[0].replaceChildren(...rows);
}

function drawCensus(census) {
  // Every GPU of the cluster counted, and READY nodes' GPUs by utilisation (buckets of
  // 10 %): what the node tiles, the first NODES_SHOWN nodes, cannot show of a large one.
  const box = $("census");
  if (!census) {
    box.replaceChildren();
    return;
  }
  const counts = el(
    "div",
    { class: "counts" },
    ...[
      ["busy", census.busy],
      ["shared", census.shared],
      ["free", census.free],
      ["drained", census.drained],
      ["on lost nodes", census.unavailable],
    ].map(([name, n]) => el("span", { "data-count": name }, `${n} ${name}`)),
  );
  const most = Math.max(1, ...census.utilisation);
  const bars = census.utilisation.map((n, i) =>
    el("div", {
      style: `height:${Math.round((40 * n) / most)}px;background:${heat(10 * i + 5)}`,
      title: `${n} GPU(s) at ${10 * i}-${i === census.utilisation.length - 1 ? 100 : 10 * i + 9}%`,
    }),
  );
  const unreported = census.unreported ? ` · ${census.unreported} not reported` : "";
  box.replaceChildren(
    counts,
    el("div", { class: "histogram", title: "GPUs by utilisation, 0 to 100 %" }, ...bars),
    el("span", { class: "muted small" }, `utilisation 0 → 100 %${unreported}`),
  );
}

async function refresh() {
  const [status, nodes, jobs, queues] = await Promise.all([
    api("/v1/status"),
    // The first NODES_SHOWN by name: a page of them, not every node of a large cluster
    // every REFRESH_MS (alnair nodes lists them all).
    api(`/v1/nodes?limit=${NODES_SHOWN}`),
    api("/v1/jobs?state=PENDING&state=RUNNING"),
    api("/v1/queues"),
  ]);
  const now = Date.now() / 1000;
  $("status").textContent =
    `brain ${status.brain_host} · epoch ${status.epoch} · ${status.nodes} nodes · ` +
    `${status.gpus} schedulable GPUs · ${status.policy}`;
  const running = jobs.jobs.filter((j) => j.state === "RUNNING");
  // Who holds each GPU whole (a share is named with its GPU's shares, from the node).
  const holders = new Map();
  for (const job of running) {
    if (job.spec.gpu_milli != null) continue;
    for (const grant of job.grants) {
      for (const gpu of grant.gpus) holders.set(`${grant.node}/${gpu}`, job.job_id);
    }
  }
  drawCensus(status.census);
  drawNodes(nodes.nodes, holders, nodes.next_after ? status.nodes : null);
  drawQueue(jobs.jobs.filter((j) => j.state === "PENDING"), now);
  drawQueues(queues.queues);
  drawRunning(running, new Map(jobs.profiles.map((p) => [p.job_id, p])));
}

// -- the event stream (Server-Sent Events) ---------------------------------------------

function describe(entry) {
  if (entry.kind === "job") {
    const change = entry.previous && entry.previous !== entry.job.state
      ? `${entry.previous}→${entry.job.state}` : entry.job.state;
    return `job ${entry.job.job_id} ${change}: ${entry.cause.message}`;
  }
  if (entry.kind === "node") return `node ${entry.node.name} ${entry.node.state}: ${entry.cause.message}`;
  if (entry.kind === "node_event") {
    const event = entry.event;
    return `node ${event.node} ${event.kind}${event.job_id ? ` job ${event.job_id}` : ""}`;
  }
  return entry.kind;
}

let stream = null;

function follow() {
  if (stream) stream.close();
  const token = encodeURIComponent(sessionStorage.getItem(TOKEN_KEY) || "");
  stream = new EventSource(`/v1/events?format=sse&tail=50&access_token=${token}`);
  const add = (message) => {
    const entry = JSON.parse(message.data);
    const time = new Date(entry.ts * 1000).toLocaleTimeString();
    const list = $("events");
    list.prepend(el("li", { class: entry.kind }, `#${entry.seq}  ${time}  ${describe(entry)}`));
    while (list.children.length > MAX_EVENTS) list.lastChild.remove();
  };
  for (const kind of ["job", "node", "node_event", "blacklist"]) stream.addEventListener(kind, add);
}

// -- start -----------------------------------------------------------------------------

let timer = null;

async function tick() {
  try {
    await refresh();
  } catch (error) {
    if (error instanceof Unauthorized) {
      clearInterval(timer);
      if (stream) stream.close();
      askForToken(error.message);
      return;
    }
    $("status").textContent = `cannot reach the brain: ${error.message}`;
  }
}

async function start() {
  if (!sessionStorage.getItem(TOKEN_KEY)) {
    askForToken();
    return;
  }
  try {
    const who = await api("/v1/whoami");
    $("who").textContent = who.operator ? `operator (${who.tenant})` : `tenant ${who.tenant}`;
  } catch (error) {
    askForToken(error.message);
    return;
  }
  $("login").hidden = true;
  $("main").hidden = false;
  drawLegend();
  await tick();
  clearInterval(timer);
  timer = setInterval(tick, REFRESH_MS);
  follow();
}

takeTokenFromAddress();
start();
