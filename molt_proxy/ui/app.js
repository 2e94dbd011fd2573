// molt-proxy's trajectory viewer: read-only pages over the proxy's own routes.
//   #/            open sessions and finalized trajectories (filters; live from the stream);
//                 #/?group=..&status=..&min=..&max=.. opens it filtered (the filters keep it so)
//   #/t/<seq>     one trajectory: tokens coloured by logprob, loss mask, turns, versions, tool calls
//   #/g/<group>   the attempts of one group side by side, with the advantages the trainer posted
// With keys on, the data routes need the admin key; it is kept in this tab's sessionStorage.
"use strict";

const main = document.getElementById("main");
const state = { trajectories: [], lastSeq: 0, following: false };

function headers() {
  const key = sessionStorage.getItem("molt.key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: headers() });
  if (response.status === 401 || response.status === 403) {
    document.getElementById("keyform").hidden = false;
    throw new Error("this proxy needs its admin key");
  }
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

document.getElementById("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("molt.key", document.getElementById("key").value);
  document.getElementById("keyform").hidden = true;
  start();
});

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

const fmt = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const ago = (t) => `${Math.max(0, Math.round(Date.now() / 1000 - t))} s ago`;

// -- the trajectory stream: every finalized trajectory, then each new one (SSE over fetch, so
// that it can carry the key; EventSource cannot send headers)

function brief(t) {
  const side = t.info && t.info.side === true;
  return {
    seq: t.seq, trajectory_id: t.trajectory_id, session_id: t.session_id, segment: t.segment,
    num_segments: t.num_segments, group_id: t.group_id, reward: t.reward, created: t.created,
    status: side ? "side" : t.status, turns: t.turns.length, num_tokens: t.token_ids.length,
    num_sampled: t.loss_mask.reduce((a, b) => a + b, 0),
  };
}

async function loadTrajectories() {
  for (;;) {
    const page = await api(`/ui/api/trajectories?after=${state.lastSeq}&limit=1000`);
    state.trajectories.push(...page.data);
    if (!page.data.length) return;
    state.lastSeq = page.last_seq;
  }
}

async function follow() {
  const live = document.getElementById("live");
  const response = await fetch(`/v1/trajectories?after=${state.lastSeq}`, {
    headers: { ...headers(), Accept: "text/event-stream" },
  });
  if (!response.ok) return;
  live.className = "live on";
  live.textContent = "stream: live";
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
      if (!data) continue;
      const t = JSON.parse(data);
      if (t.seq <= state.lastSeq) continue;
      state.lastSeq = t.seq;
      state.trajectories.push(brief(t));
      if (onList()) renderList();
    }
  }
  live.className = "live off";
  live.textContent = "stream: closed";
}

// -- the list ----------------------------------------------------------------------------------

const filters = { group: "", status: "", min: "", max: "" };
const onList = () => !location.hash.startsWith("#/t/") && !location.hash.startsWith("#/g/");

function readFilters() {
  const query = new URLSearchParams(location.hash.split("?")[1] || "");
  for (const name of Object.keys(filters)) filters[name] = query.get(name) || "";
}

function setFilter(name, value) {
  filters[name] = value;
  const query = new URLSearchParams(Object.entries(filters).filter(([, v]) => v !== ""));
  history.replaceState(null, "", `#/${query.size ? "?" + query : ""}`);
  renderList();
}

function shown(t) {
  if (filters.group && !t.group_id.includes(filters.group)) return false;
  if (filters.status && t.status !== filters.status) return false;
  if (filters.min !== "" && !(t.reward !== null && t.reward >= Number(filters.min))) return false;
  if (filters.max !== "" && !(t.reward !== null && t.reward <= Number(filters.max))) return false;
  return true;
}

function filterBar() {
  const bar = el("div", { class: "filters" });
  const input = (name, placeholder, type = "text") => {
    const box = el("input", { type, placeholder, value: filters[name], id: `filter-${name}` });
    box.addEventListener("change", () => setFilter(name, box.value));
    return box;
  };
  const status = el("select", { id: "filter-status" });
  for (const value of ["", "rewarded", "unrewarded", "side"]) {
    const option = el("option", { value, text: value || "any status" });
    if (value === filters.status) option.selected = true;
    status.append(option);
  }
  status.addEventListener("change", () => setFilter("status", status.value));
  bar.append("group", input("group", "contains"), status, "reward ≥", input("min", "min", "number"),
    "≤", input("max", "max", "number"));
  return bar;
}

async function renderList() {
  let sessions = [];
  try {
    sessions = (await api("/ui/api/sessions")).data;
  } catch (error) {
    main.replaceChildren(el("p", { class: "error", text: error.message }));
    return;
  }
  const open = el("table", { id: "sessions" },
    el("tr", {}, ...["session", "group", "chains", "turns", "tokens", "last turn"].map((h) => el("th", { text: h }))));
  for (const s of sessions) {
    const turns = s.segments.reduce((n, seg) => n + seg.turns.length, 0);
    const tokens = s.segments.reduce((n, seg) => n + seg.num_tokens, 0);
    open.append(el("tr", { class: "session" }, el("td", { text: s.session_id }), el("td", { text: s.group_id }),
      el("td", { text: s.segments.length }), el("td", { text: turns }), el("td", { text: tokens }),
      el("td", { text: ago(s.last_active) })));
  }
  const done = el("table", { id: "trajectories" },
    el("tr", {}, ...["seq", "trajectory", "group", "status", "reward", "turns", "tokens", "sampled"]
      .map((h) => el("th", { text: h }))));
  for (const t of state.trajectories.filter(shown).reverse()) {
    done.append(el("tr", { class: "trajectory" },
      el("td", {}, el("a", { href: `#/t/${t.seq}`, text: t.seq })), el("td", { text: t.trajectory_id }),
      el("td", {}, el("a", { href: `#/g/${encodeURIComponent(t.group_id)}`, text: t.group_id })),
      el("td", { text: t.status }), el("td", { text: fmt(t.reward) }), el("td", { text: t.turns }),
      el("td", { text: t.num_tokens }), el("td", { text: t.num_sampled })));
  }
  main.replaceChildren(el("h2", { text: `Open sessions (${sessions.length})` }), open,
    el("h2", { text: `Finalized trajectories (${state.trajectories.length})` }), filterBar(), done);
}

// -- one trajectory ------------------------------------------------------------------------

function colour(logprob) {
  const p = Math.exp(logprob); // 0 → red, 1 → green
  return `hsl(${Math.round(120 * p)}, 75%, 78%)`;
}

function tokenSpan(t, i) {
  const sampled = t.loss_mask[i] === 1;
  const span = el("span", { class: sampled ? "tok sampled" : "tok prompt", text: t.pieces[i] });
  if (sampled) {
    span.style.background = colour(t.logprobs[i]);
    span.title = `id ${t.token_ids[i]} · logprob ${fmt(t.logprobs[i], 4)} · p ${fmt(Math.exp(t.logprobs[i]))}` +
      ` · weights v${t.weight_versions[i]}`;
  } else {
    span.title = `id ${t.token_ids[i]} · prompt (mask 0)`;
  }
  return span;
}

function turnBlock(t, turn, index) {
  const sampled = turn.completion_end - turn.completion_start;
  const versions = [...new Set(t.weight_versions.slice(turn.completion_start, turn.completion_end))];
  const lps = t.logprobs.slice(turn.completion_start, turn.completion_end);
  const mean = lps.length ? lps.reduce((a, b) => a + b, 0) / lps.length : null;
  const head = el("div", { class: "head" }, el("b", { text: `turn ${index}` }), el("span", { text: turn.completion_id }),
    el("span", { class: "sampled-count", text: `${sampled} sampled` }), el("span", { text: `finish: ${turn.finish_reason}` }),
    el("span", { text: `weights v${versions.join(", v")}` }), el("span", { text: `mean logprob ${fmt(mean)}` }));
  if (turn.reward !== null && turn.reward !== undefined) head.append(el("span", { text: `turn reward ${fmt(turn.reward)}` }));
  if (turn.constrained) head.append(el("span", { text: "constrained" }));
  const perTurn = t.advantages && t.advantages.turn_advantages;
  if (perTurn) head.append(el("span", { class: "turn-advantage", text: `advantage ${fmt(perTurn[index])}` }));
  const tokens = el("div", { class: "tokens" });
  for (let i = turn.prompt_start; i < turn.completion_end; i++) {
    if (i === turn.completion_start) tokens.append(el("span", { class: "boundary", text: "▼ sampled" }));
    tokens.append(tokenSpan(t, i));
  }
  const block = el("div", { class: "turn", "data-turn": index }, head, tokens);
  const calls = (turn.reply && turn.reply.tool_calls) || [];
  if (calls.length) {
    const list = el("div", { class: "calls" }, "tool calls: ");
    for (const call of calls) list.append(el("code", { class: "call", text: `${call.function.name}(${call.function.arguments})` }), " ");
    block.append(list);
  }
  return block;
}

async function renderTrajectory(seq) {
  const t = await api(`/ui/api/trajectories/${seq}`);
  const first = t.seq - t.segment;
  const siblings = el("span");
  for (let k = 0; k < t.num_segments; k++) {
    siblings.append(k === t.segment ? el("b", { text: `${k}` }) : el("a", { href: `#/t/${first + k}`, text: `${k}` }), " ");
  }
  const meta = el("dl", { class: "meta" });
  const row = (name, value) => meta.append(el("dt", { text: name }), el("dd", {}, value));
  row("trajectory", t.trajectory_id);
  row("segment (chain)", siblings);
  row("group", el("a", { href: `#/g/${encodeURIComponent(t.group_id)}`, text: t.group_id }));
  row("reward", `${fmt(t.reward)} (${t.status})`);
  row("info", JSON.stringify(t.info));
  row("tokens", `${t.token_ids.length}, of which ${t.loss_mask.reduce((a, b) => a + b, 0)} sampled (loss mask 1)`);
  row("model", t.model);
  row("advantage", advantageText(t, null));
  const legend = el("div", { class: "legend" }, "sampled token p = exp(logprob): 0", el("span", { class: "scale" }), "1",
    el("span", { class: "tok prompt legend", text: " grey: prompt, mask 0" }));
  const turns = el("div", { id: "turns" });
  let covered = 0;
  t.turns.forEach((turn, index) => {
    if (turn.prompt_start > covered) { // tokens before this turn's prompt (none in today's records)
      const rest = el("div", { class: "tokens" });
      for (let i = covered; i < turn.prompt_start; i++) rest.append(tokenSpan(t, i));
      turns.append(rest);
    }
    turns.append(turnBlock(t, turn, index));
    covered = turn.completion_end;
  });
  main.replaceChildren(el("h2", { text: `Trajectory ${t.seq}` }), meta, legend, turns);
}

// -- one group -----------------------------------------------------------------------------

function advantageText(t, mean) {
  const a = t.advantages;
  if (a) {
    const value = a.turn_advantages ? `turn advantages ${a.turn_advantages.map((x) => fmt(x)).join(", ")}`
      : `advantage ${fmt(a.advantage)}`;
    return `${value} (posted by the trainer: step ${a.step}, weights v${a.version})`;
  }
  if (mean === null) return "– (not posted by the trainer)";
  return `reward − group mean ${t.reward === null ? "–" : fmt(t.reward - mean)} (the trainer posted no advantage)`;
}

async function renderGroup(group) {
  const members = state.trajectories.filter((t) => t.group_id === group);
  const rewards = members.filter((t) => t.reward !== null).map((t) => t.reward);
  const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
  const row = el("div", { class: "group" });
  for (const m of members) {
    const t = await api(`/ui/api/trajectories/${m.seq}`);
    const body = el("div", { class: "tokens" });
    const perTurn = t.advantages && t.advantages.turn_advantages;
    t.turns.forEach((turn, k) => {
      const label = `turn ${turn.completion_id.slice(-6)}${perTurn ? ` · advantage ${fmt(perTurn[k])}` : ""}`;
      body.append(el("span", { class: "boundary", text: label }));
      for (let i = turn.completion_start; i < turn.completion_end; i++) body.append(tokenSpan(t, i));
    });
    const head = el("div", { class: "head" }, el("a", { href: `#/t/${t.seq}`, text: t.trajectory_id }), el("br"),
      el("span", { class: "advantage", text: `reward ${fmt(t.reward)} · ${advantageText(t, mean)}` }),
      ` · ${t.turns.length} turns`);
    row.append(el("div", { class: "attempt" }, head, body));
  }
  main.replaceChildren(el("h2", { text: `Group ${group}: ${members.length} trajectories, mean reward ${fmt(mean)}` }),
    el("p", { text: "Sampled tokens of each attempt, coloured by p = exp(logprob)." }), row);
}

// -- routing -------------------------------------------------------------------------------

async function route() {
  const [, page, arg] = location.hash.split("/");
  try {
    if (page === "t") await renderTrajectory(Number(arg));
    else if (page === "g") await renderGroup(decodeURIComponent(arg));
    else { readFilters(); await renderList(); }
  } catch (error) {
    main.replaceChildren(el("p", { class: "error", text: error.message }));
  }
}

async function start() {
  try {
    state.trajectories = [];
    state.lastSeq = 0;
    await loadTrajectories();
  } catch (error) {
    main.replaceChildren(el("p", { class: "error", text: error.message }));
    return;
  }
  await route();
  if (state.following) return;
  state.following = true;
  follow();
  setInterval(() => { if (onList()) renderList(); }, 5000);
}

window.addEventListener("hashchange", route);
start();
