// The page's views.  Each has mount(root, query) (its controls, once), load(force) (fetch and draw its data;
// called again every few seconds while it is shown, redrawing only what changed) and, where its address holds
// filters, update(query).
"use strict";
(function () {
  const C = window.Coffer = window.Coffer || {};
  const V = C.views = C.views || {};
  const h = (...args) => C.h(...args);

  function head(title, ...rest) {
    return h("div", {class: "view-head"}, h("h1", {text: title}), rest);
  }
  function panel(...children) { return h("div", {class: "panel"}, children); }
  function empty(text) { return h("div", {class: "empty", text: text}); }
  function stateClass(state) { return "state " + String(state || "").split(" ")[0].replace(/[^a-z]/g, ""); }
  // Redraw a region only when the service's answer changed (polling must not flicker or lose a selection).
  function changed(view, key, data) {
    view.seen = view.seen || {};
    if (view.seen[key] === data._text) return false;
    view.seen[key] = data._text;
    return true;
  }

  // -- Servers -------------------------------------------------------------------------------------------------
  V.servers = {
    title: "Servers",
    mount(root) {
      this.open = this.open || {};
      this.seen = {};
      this.rows = new Map();
      this.tbody = null;
      this.summary = h("p", {class: "muted"});
      this.body = h("div", {class: "panel table-wrap"}, h("p", {class: "muted pad", text: "Loading…"}));
      root.append(head("Servers", this.summary), this.body);
    },
    async load() {
      const data = await C.get("servers");
      if (!changed(this, "servers", data)) return;
      const servers = data.servers;
      const ready = servers.filter((s) => s.state === "ready").length, failed = servers.filter((s) => s.state === "failed").length;
      this.summary.textContent = servers.length + " registered · " + ready + " running" + (failed ? " · " + failed + " failed" : "");
      if (!servers.length) {
        this.tbody = null;
        C.replace(this.body, empty("No servers yet. Add one in a terminal: coffer add NAME -- COMMAND, or coffer import."));
        return;
      }
      if (!this.tbody) {
        this.tbody = h("tbody");
        this.rows = new Map();
        C.replace(this.body, h("table", {id: "servers-table"},
          h("thead", {}, h("tr", {}, ["Server", "State", "PID", "Memory", "Sharing", "Sessions", "Capabilities", "Last call", ""]
            .map((text) => h("th", {text: text})))), this.tbody));
      }
      // A row is rebuilt only when what it shows changed beyond its live numbers (memory, process, sessions, last
      // call), which are updated in place: a button under the pointer is never swapped out by a refresh.
      const next = new Map(), ordered = [];
      for (const server of servers) {
        const open = !!this.open[server.name];
        const stable = open ? JSON.stringify(server) + "+" :
          JSON.stringify(Object.assign({}, server, {pid: 0, rss_mb: 0, sessions: 0, last_call: 0, instances: 0}));
        let entry = this.rows.get(server.name);
        if (!entry || entry.stable !== stable) entry = Object.assign(this.row(server, open), {stable: stable});
        else entry.update(server);
        next.set(server.name, entry);
        ordered.push(...entry.nodes);
      }
      ordered.forEach((node, i) => { if (this.tbody.children[i] !== node) this.tbody.insertBefore(node, this.tbody.children[i] || null); });
      while (this.tbody.children.length > ordered.length) this.tbody.lastChild.remove();
      this.rows = next;
    },
    row(server, open) {
      const view = this, counts = server.counts || {};
      const caps = [];
      if (counts.tools) caps.push(C.n(counts.tools) + " tools");
      if (counts.prompts) caps.push(C.n(counts.prompts) + " prompts");
      if (counts.resources) caps.push(C.n(counts.resources) + " resources");
      const notes = [];
      if (counts.disabled) notes.push(h("span", {class: "pill", text: counts.disabled + " off"}));
      if (counts.changed) notes.push(h("a", {class: "pill warn", href: "#/changes", text: counts.changed + " changed"}));
      const toggle = h("button", {class: "small", text: server.enabled ? "Disable" : "Enable",
        on: {click: (e) => { e.stopPropagation(); C.act(e.target, server.enabled ? "disable" : "enable", {target: server.name}); }}});
      const restart = h("button", {class: "small", text: server.state === "failed" ? "Retry" : "Restart",
        title: "Start it again from scratch (its calls in flight fail)",
        disabled: !server.enabled || !!server.damaged,
        on: {click: (e) => { e.stopPropagation(); C.act(e.target, "restart", {server: server.name}); }}});
      const live = {pid: h("td", {class: "num"}), memory: h("td", {class: "num"}), sessions: h("td", {class: "num"}),
        last: h("td", {class: "nowrap"})};
      const update = function (s) {
        live.pid.textContent = s.pid || "–";
        live.memory.textContent = C.mb(s.rss_mb);
        live.sessions.textContent = s.sessions;
        live.last.textContent = s.last_call ? C.when(s.last_call) : "–";
        live.last.title = C.local(s.last_call);
      };
      update(server);
      const main = h("tr", {class: "clickable", data: {server: server.name},
        on: {click: (e) => { if (e.target.closest("a, button")) return; view.open[server.name] = !open; view.seen = {}; view.load(); }}},
        h("td", {},
          h("b", {text: server.name}), " ", h("span", {class: "pill", text: server.transport}),
          h("span", {class: "sub mono", text: server.command, title: server.command}),
          server.error ? h("div", {class: "error-line", text: server.error.split("\n")[0].slice(0, 240)}) : null),
        h("td", {}, h("span", {class: stateClass(server.state), text: server.state})),
        live.pid, live.memory,
        h("td", {}, server.sharing, server.sharing_reason ? h("span", {class: "sub", text: server.sharing_reason}) : null),
        live.sessions,
        h("td", {}, caps.length ? h("a", {href: "#/catalogue?server=" + encodeURIComponent(server.name), text: caps.join(" · "),
          title: "Show them in the catalogue"}) : h("span", {class: "muted", text: "none seen yet"}), " ", notes),
        live.last,
        h("td", {class: "nowrap"}, toggle, " ", restart));
      const nodes = open ? [main, h("tr", {class: "details"}, h("td", {colspan: 9}, this.details(server)))] : [main];
      return {nodes: nodes, update: update};
    },
    details(server) {
      const fixes = (server.problems || []).map((p) => h("div", {class: "fix"},
        h("span", {class: "pill " + (p.severity === "error" ? "bad" : "warn"), text: p.severity}),
        h("div", {}, h("div", {text: p.problem}), h("code", {text: p.fix}))));
      const env = Object.entries(Object.assign({}, server.env, server.headers));
      return h("div", {class: "details-grid"},
        h("div", {},
          h("h3", {text: server.error ? "Last error" : "Health"}),
          server.error ? h("pre", {class: "stderr", text: server.error}) : h("p", {class: "muted", text: "No error recorded."}),
          fixes.length ? h("div", {}, h("h3", {text: "Fix"}), fixes) : null,
          server.stderr && server.stderr.length ? h("div", {}, h("h3", {text: "Its last stderr lines"}),
            h("pre", {class: "stderr", text: server.stderr.join("\n")})) : null),
        h("div", {},
          h("h3", {text: "Definition"}),
          h("dl", {class: "kv"},
            h("dt", {text: "command"}), h("dd", {class: "mono", text: server.command}),
            h("dt", {text: "new capabilities"}), h("dd", {text: server.policy || "–"}),
            h("dt", {text: "changed definitions"}), h("dd", {text: server.updates === "trust" ? "apply at once (trust-updates)" : "wait for approval"}),
            h("dt", {text: "sharing"}), h("dd", {text: server.sharing + (server.sharing_reason ? " (" + server.sharing_reason + ")" : "")}),
            h("dt", {text: "status since"}), h("dd", {text: C.local(server.status_at) || "–"}),
            env.map(([k, v]) => [h("dt", {class: "mono", text: k}), h("dd", {class: "mono", text: v})]),
            server.secrets.length ? [h("dt", {text: "secrets used"}), h("dd", {},
              server.secrets.map((name) => h("span", {class: "pill " + (server.secrets_missing.includes(name) ? "bad" : "good"),
                text: name + (server.secrets_missing.includes(name) ? " (missing)" : "")}))) ] : null),
          server.instances && server.instances.length ? h("div", {}, h("h3", {text: "Instances (one per client)"}),
            h("table", {}, h("tbody", {}, server.instances.map((i) => h("tr", {},
              h("td", {text: i.client}), h("td", {}, h("span", {class: stateClass(i.state), text: i.state})),
              h("td", {class: "num", text: i.pid || "–"}), h("td", {class: "num", text: C.mb(i.rss_mb)})))))) : null));
    },
  };

  // -- Catalogue -----------------------------------------------------------------------------------------------
  const PAGE = 100;
  V.catalogue = {
    title: "Catalogue",
    mount(root, query) {
      this.seen = {};
      this.filter = {server: query.get("server") || "", q: query.get("q") || "", kind: query.get("kind") || "",
        state: query.get("state") || "", page: parseInt(query.get("page") || "0", 10) || 0};
      const view = this;
      let timer = null;
      this.box = h("input", {type: "search", class: "grow", placeholder: "Filter by name or description  ( / )",
        value: this.filter.q, "aria-label": "Filter",
        on: {input: () => { clearTimeout(timer); timer = setTimeout(() => view.set({q: view.box.value, page: 0}), 120); }}});
      const select = (name, options, label) => h("select", {"aria-label": label, on: {change: (e) => view.set({[name]: e.target.value, page: 0})}},
        options.map(([value, text]) => h("option", {value: value, text: text, selected: view.filter[name] === value})));
      this.count = h("span", {class: "muted"});
      this.list = h("div", {class: "panel server-list"});
      this.table = h("div", {class: "panel"}, h("p", {class: "muted pad", text: "Loading…"}));
      root.append(head("Catalogue", h("p", {class: "muted", text: "Every tool, prompt and resource of every server, as agents are offered them."})),
        h("div", {class: "split"}, this.list, h("div", {},
          h("div", {class: "toolbar"}, this.box,
            select("kind", [["", "All kinds"], ["tool", "Tools"], ["prompt", "Prompts"], ["resource", "Resources"]], "Kind"),
            select("state", [["", "Any state"], ["enabled", "Enabled"], ["disabled", "Disabled"], ["changed", "Changed (held back)"],
              ["server off", "Server disabled"], ["gone", "No longer listed"]], "State"), this.count),
          this.table)));
    },
    set(values) {
      Object.assign(this.filter, values);
      C.setQuery({server: this.filter.server, q: this.filter.q, kind: this.filter.kind, state: this.filter.state,
        page: this.filter.page || ""});
      this.load(true);
    },
    async load() {
      const f = this.filter;
      const data = await C.get("catalogue", {server: f.server, q: f.q, kind: f.kind, state: f.state,
        offset: f.page * PAGE, limit: PAGE});
      if (!changed(this, "catalogue", data)) return;
      this.drawServers(data);
      const first = data.matched ? data.offset + 1 : 0, last = Math.min(data.offset + data.limit, data.matched);
      this.count.textContent = data.matched === data.total ? C.n(data.total) + " in all" :
        C.n(data.matched) + " of " + C.n(data.total) + " match";
      if (!data.rows.length) {
        C.replace(this.table, empty(data.total ? "Nothing matches this filter." :
          "Nothing listed yet: servers list their tools when they first start."));
        return;
      }
      const pages = Math.max(1, Math.ceil(data.matched / PAGE));
      const pager = h("div", {class: "pager"},
        h("span", {class: "muted", text: C.n(first) + "–" + C.n(last) + " of " + C.n(data.matched)}),
        h("button", {class: "small", text: "‹ Previous", disabled: f.page <= 0, on: {click: () => this.set({page: f.page - 1})}}),
        h("span", {class: "muted", text: "page " + (f.page + 1) + " of " + pages}),
        h("button", {class: "small", text: "Next ›", disabled: f.page + 1 >= pages, on: {click: () => this.set({page: f.page + 1})}}));
      C.replace(this.table, h("div", {class: "table-wrap"}, h("table", {id: "catalogue-table"},
        h("thead", {}, h("tr", {}, h("th", {text: "On"}), h("th", {text: "Name"}), h("th", {text: "Kind"}),
          h("th", {text: "Description"}), h("th", {text: "State"}))),
        h("tbody", {}, data.rows.map((row) => this.row(row))))), pager);
    },
    row(row) {
      const toggle = h("button", {class: "switch", role: "switch", "aria-checked": row.enabled ? "true" : "false",
        "aria-label": (row.enabled ? "Disable " : "Enable ") + row.name, title: row.enabled ? "Disable" : "Enable",
        disabled: row.state === "gone", data: {target: row.target},
        on: {click: (e) => {
          const button = e.currentTarget;
          button.classList.add("pending");
          button.setAttribute("aria-checked", row.enabled ? "false" : "true");
          C.act(button, row.enabled ? "disable" : "enable", {target: row.target});
        }}});
      const state = row.state === "changed" ? h("a", {href: "#/changes", class: "pill warn", text: "changed: review"}) :
        h("span", {class: stateClass(row.state === "server off" ? "off" : row.state), text: row.state});
      const view = this, key = row.server + " " + row.kind + " " + row.upstream;
      const main = h("tr", {class: "clickable", data: {name: row.name, server: row.server}, title: "Show its definition",
        on: {click: (e) => { if (!e.target.closest("button, a")) view.expand(key, row); }}},
        h("td", {}, toggle),
        h("td", {}, h("span", {class: "cap-name", text: row.name}), row.title ? h("span", {class: "sub", text: row.title}) : null),
        h("td", {}, h("span", {class: "pill", text: row.kind})),
        h("td", {}, h("span", {class: "desc", text: row.description, title: row.description})),
        h("td", {}, state));
      const shownDetails = this.expanded && this.expanded.key === key ? this.expanded.details : null;
      return shownDetails ? [main, h("tr", {class: "details"}, h("td", {colspan: 5}, shownDetails))] : main;
    },
    // A row expands to the whole definition: every parameter with its type and description, and when it was seen.
    async expand(key, row) {
      if (this.expanded && this.expanded.key === key) { this.expanded = null; this.seen = {}; this.load(); return; }
      let data;
      try {
        data = await C.get("capability", {server: row.server, kind: row.kind, name: row.upstream});
      } catch (error) { C.toast(error.message, "bad"); return; }
      const d = data.definition, schema = d.inputSchema || d.arguments || {};
      const properties = Array.isArray(schema) ? schema.map((a) => [a.name, a]) : Object.entries(schema.properties || {});
      const required = new Set(Array.isArray(schema) ? schema.filter((a) => a.required).map((a) => a.name) : schema.required || []);
      this.expanded = {key: key, details: h("div", {class: "details-grid"},
        h("div", {}, h("h3", {text: "Description"}), h("pre", {class: "definition", text: d.description || "(none)"}),
          h("p", {class: "muted", text: "first seen " + C.local(data.first_seen) + " · listed " + C.when(data.last_seen)})),
        h("div", {}, h("h3", {text: properties.length ? "Parameters" : (d.uri || d.uriTemplate ? "Resource" : "No parameters")}),
          properties.length ? h("table", {class: "explain"}, h("tbody", {}, properties.map(([name, p]) => h("tr", {},
            h("td", {class: "mono", text: name + (required.has(name) ? " *" : "")}),
            h("td", {class: "muted", text: (p && (p.type || (p.enum ? "enum" : ""))) || ""}),
            h("td", {text: (p && p.description) || ""}))))) :
            (d.uri || d.uriTemplate ? h("p", {class: "mono", text: (d.uri || d.uriTemplate) + (d.mimeType ? " (" + d.mimeType + ")" : "")}) : null)))};
      this.seen = {};
      this.load();
    },
    drawServers(data) {
      const view = this, f = this.filter;
      const total = data.servers.reduce((sum, s) => sum + s.counts.total, 0);
      const item = (name, label, count, off) => h("button", {"aria-pressed": f.server === name ? "true" : "false",
        on: {click: () => view.set({server: name, page: 0})}},
        h("span", {class: off ? "off" : "", text: label}), h("span", {class: "muted", text: C.n(count)}));
      C.replace(this.list, item("", "All servers", total),
        data.servers.map((s) => item(s.name, s.name, s.counts.total, !s.enabled)));
    },
  };

  // -- Changed definitions -------------------------------------------------------------------------------------
  V.changes = {
    title: "Changed definitions",
    mount(root) {
      this.seen = {};
      this.body = h("div", {}, h("p", {class: "muted", text: "Loading…"}));
      root.append(head("Changed definitions", h("p", {class: "muted",
        text: "A tool, prompt or resource whose definition changed upstream is held back from agents until you approve it."})), this.body);
    },
    async load() {
      const data = await C.get("changes");
      if (!changed(this, "changes", data)) return;
      if (!data.changes.length) {
        C.replace(this.body, panel(empty("Nothing is waiting for approval. When a server changes a description or a schema, it appears here first.")));
        return;
      }
      const byServer = {};
      for (const item of data.changes) (byServer[item.server] = byServer[item.server] || []).push(item);
      C.replace(this.body, Object.entries(byServer).map(([server, items]) => h("section", {},
        h("div", {class: "view-head"}, h("h2", {text: server}),
          items.length > 1 ? h("button", {class: "small", text: "Approve all " + items.length,
            on: {click: (e) => C.act(e.target, "approve", {target: server})}}) : null),
        items.map((item) => this.card(item)))));
    },
    card(item) {
      return h("div", {class: "panel change", data: {target: item.target}},
        h("div", {class: "change-head"},
          h("span", {class: "pill", text: item.kind}), h("b", {class: "cap-name", text: item.name}),
          h("span", {class: "muted", title: C.local(item.changed_at), text: item.changed_at ? "changed " + C.when(item.changed_at) : ""}),
          item.enabled ? null : h("span", {class: "pill", text: "disabled"}),
          h("span", {class: "spacer"}),
          h("button", {class: "primary small approve", text: "Approve", on: {click: (e) => C.act(e.target, "approve", {target: item.target})}})),
        item.changes.map((change) => this.change(change)),
        h("details", {}, h("summary", {text: "The whole diff (as coffer approve prints it)"}), this.unified(item.diff)));
    },
    change(change) {
      const label = {added: "added", removed: "removed", changed: "changed"}[change.change];
      const body = [];
      if (change.words) {
        body.push(h("div", {class: "words"}, change.words.map(([op, text]) =>
          op === "+" ? h("ins", {text: text}) : op === "-" ? h("del", {text: text}) : text)));
      } else if (change.change === "changed") {
        body.push(h("div", {class: "before-after"}, h("pre", {class: "before", text: change.before}), h("pre", {class: "after", text: change.after})));
      } else {
        body.push(h("pre", {class: change.change === "added" ? "after" : "before", text: change.after || change.before}));
      }
      return h("div", {class: "field-change"}, h("span", {class: "path", text: change.path}), " ",
        h("span", {class: "pill " + (change.change === "removed" ? "bad" : change.change === "added" ? "good" : "warn"), text: label}), body);
    },
    unified(diff) {
      return h("pre", {class: "unified"}, (diff || "(no visible difference)").split("\n").map((line) =>
        h("span", {class: line.startsWith("@@") ? "hunk" : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "", text: line + "\n"})));
    },
  };

  // -- Activity ------------------------------------------------------------------------------------------------
  V.activity = {
    title: "Activity",
    mount(root, query) {
      this.seen = {};
      this.filter = {range: query.get("range") || "day", group: query.get("group") || "server", only: query.get("only") || ""};
      this.controls = h("div", {class: "toolbar"});
      this.body = h("div", {}, h("p", {class: "muted", text: "Loading…"}));
      root.append(head("Activity", h("p", {class: "muted", text: "From the invocation log: who called what, when, how long, how it ended (never arguments or results)."})),
        this.controls, this.body);
      this.drawControls({server: [], client: []});
    },
    set(values) {
      Object.assign(this.filter, values);
      C.setQuery(this.filter);
      this.seen = {};
      this.load();
    },
    drawControls(choices) {
      const f = this.filter, view = this;
      const segment = (name, options) => h("span", {class: "segmented"}, options.map(([value, text]) =>
        h("button", {"aria-pressed": f[name] === value ? "true" : "false", text: text, data: {[name]: value},
          on: {click: () => view.set(name === "group" ? {group: value, only: ""} : {[name]: value})}})));
      const names = choices[f.group] || [];
      C.replace(this.controls,
        segment("range", [["day", "Last 24 hours"], ["week", "Last 7 days"]]),
        segment("group", [["server", "By server"], ["client", "By client"]]),
        h("select", {"aria-label": "Only", on: {change: (e) => view.set({only: e.target.value})}},
          h("option", {value: "", text: "All " + f.group + "s"}),
          names.concat(f.only && !names.includes(f.only) ? [f.only] : []).map((name) =>
            h("option", {value: name, text: name, selected: f.only === name}))));
    },
    async load() {
      const f = this.filter;
      const data = await C.get("activity", {range: f.range, group: f.group, only: f.only});
      if (!changed(this, "activity", data)) return;
      this.drawControls(data.choices);
      const t = data.total, week = f.range === "week";
      const kpi = (value, label) => h("div", {class: "panel kpi"}, h("b", {text: value}), h("span", {text: label}));
      const series = data.series.map((one, i) => ({name: one.name, values: one.calls, cls: one.others ? "s6" : "s" + i}));
      const calls = C.barChart({chart: "calls", label: "Calls per hour", hours: data.hours, series: series,
        format: (v) => C.n(v) + (v === 1 ? " call" : " calls"), axis: (v) => C.n(Math.round(v * 10) / 10)});
      const latency = C.lineChart({chart: "duration", label: "Duration per hour", hours: data.hours,
        lines: [{name: "p50", values: data.p50_ms, cls: "p50"}, {name: "p95", values: data.p95_ms, cls: "p95"}], format: C.ms});
      const errors = C.barChart({chart: "errors", label: "Error rate per hour", hours: data.hours, max: 1,
        series: [{name: "error rate", values: data.error_rate.map((v) => v || 0), cls: "err"}], format: C.pct});
      const chart = (title, legend, svg) => h("div", {class: "panel chart"}, h("h3", {}, title, legend), svg);
      C.replace(this.body,
        h("div", {class: "kpis"}, kpi(C.n(t.calls), "calls in the last " + (week ? "7 days" : "24 hours")),
          kpi(C.n(t.errors) + (t.calls ? " (" + C.pct(t.error_rate) + ")" : ""), "failed (error, timeout, denied)"),
          kpi(C.ms(t.p50_ms), "median duration (p50)"), kpi(C.ms(t.p95_ms), "p95 duration")),
        h("div", {class: "charts"},
          chart("Calls per hour", C.legend(series.map((s) => ({name: s.name, cls: s.cls}))), calls),
          chart("Duration", C.legend([{name: "p50", cls: "p50"}, {name: "p95", cls: "p95"}]), latency),
          chart("Error rate", C.legend([{name: "failed share of calls", cls: "err"}]), errors)),
        h("h2", {text: "By " + f.group}),
        panel(data.table.length ? h("div", {class: "table-wrap"}, h("table", {id: "activity-table"},
          h("thead", {}, h("tr", {}, ["", "Calls", "Failed", "Error rate", "p50", "p95", "Last call"].map((text, i) =>
            h("th", {class: i ? "num" : "", text: text || f.group})))),
          h("tbody", {}, data.table.map((row) => h("tr", {class: "clickable", title: "Show only " + row.name,
            on: {click: () => this.set({only: f.only === row.name ? "" : row.name})}},
            h("td", {}, h("b", {text: row.name}), row.builtin ? h("span", {class: "sub", text: "Coffer's own tools"}) : null),
            h("td", {class: "num", text: C.n(row.calls)}), h("td", {class: "num", text: C.n(row.errors)}),
            h("td", {class: "num", text: C.pct(row.error_rate)}), h("td", {class: "num", text: C.ms(row.p50_ms)}),
            h("td", {class: "num", text: C.ms(row.p95_ms)}),
            h("td", {class: "num", title: C.local(row.last), text: C.when(row.last)})))))) :
          empty("No calls in this period.")),
        h("h2", {text: "Latest failures"}),
        panel(data.latest_errors.length ? h("div", {class: "table-wrap"}, h("table", {id: "errors-table"},
          h("thead", {}, h("tr", {}, ["When", "Client", "Server", "What", "Status", "Took", "Error"].map((text) => h("th", {text: text})))),
          h("tbody", {}, data.latest_errors.map((row) => h("tr", {},
            h("td", {class: "nowrap", title: C.local(row.ts), text: C.when(row.ts)}), h("td", {text: row.client || ""}),
            h("td", {text: row.server || ""}), h("td", {class: "mono", text: row.capability || ""}),
            h("td", {}, h("span", {class: "pill bad", text: row.status})), h("td", {class: "num", text: C.ms(row.duration_ms)}),
            h("td", {text: row.error || ""})))))) : empty("No failures in this period.")));
    },
  };

  // -- Search playground ---------------------------------------------------------------------------------------
  V.search = {
    title: "Search",
    poll: false,
    mount(root, query) {
      const view = this;
      let timer = null;
      this.box = h("input", {type: "search", placeholder: "What should the agent do?  e.g. create an issue for this bug",
        value: query.get("q") || "", "aria-label": "Request", autofocus: true,
        on: {input: () => { clearTimeout(timer); timer = setTimeout(() => view.run(), 250); },
          keydown: (e) => { if (e.key === "Enter") { clearTimeout(timer); view.run(); } }}});
      this.topK = h("select", {"aria-label": "How many", on: {change: () => view.run()}},
        [5, 10, 20].map((k) => h("option", {value: k, text: "top " + k, selected: String(k) === (query.get("top_k") || "5")})));
      // An agent with a profile searches that profile's tools, under the names it sees them by.
      const asked = query.get("profile") || "";
      this.profile = h("select", {"aria-label": "As which agent", id: "search-profile", hidden: !asked, on: {change: () => view.run()}},
        h("option", {value: "", text: "any agent without a profile"}),
        asked ? h("option", {value: asked, text: "an agent of profile " + asked, selected: true}) : null);
      C.get("sessions").then((data) => {
        const names = (data.profiles || []).map((p) => p.name).filter((name) => name !== asked);
        for (const name of names) this.profile.append(h("option", {value: name, text: "an agent of profile " + name}));
        this.profile.hidden = !(asked || names.length);
      }, () => {});
      this.body = h("div", {});
      root.append(head("Search playground", h("p", {class: "muted",
        text: "The ranking coffer__search_tools gives an agent for a request, and why: which words matched which field, and what each was worth."})),
        h("div", {class: "search-box"}, this.box, this.profile, this.topK), this.body);
      setTimeout(() => this.box.focus(), 0);
      if (this.box.value) this.run();
      else C.replace(this.body, panel(empty("Type a request to see how Coffer ranks its tools for it.")));
    },
    async load() { /* the playground answers what is typed; it does not poll */ },
    async run() {
      const q = this.box.value.trim();
      const profile = this.profile.value;
      C.setQuery({q: q, top_k: this.topK.value === "5" ? "" : this.topK.value, profile: profile});
      if (!q) { C.replace(this.body, panel(empty("Type a request to see how Coffer ranks its tools for it."))); return; }
      const asked = q;
      let data;
      try { data = await C.get("search", {q: q, top_k: this.topK.value, profile: profile}); } catch (error) { C.toast(error.message, "bad"); return; }
      if (this.box.value.trim() !== asked || this.profile.value !== profile) return;   // a newer request is on its way
      this.draw(data);
    },
    draw(data) {
      const hybrid = data.ranker === "hybrid";
      const best = data.results.length ? data.results[0].score || 1 : 1;
      const reading = h("div", {class: "reading"}, h("span", {class: "muted", text: "Read as:"}),
        data.plan.words.map((w) => h("span", {class: "chip"}, w.words.join(" / "), w.weight !== 1 ? h("small", {text: "×" + w.weight}) : null)),
        data.plan.related.slice(0, 12).map((r) => h("span", {class: "chip", title: r.how}, h("small", {text: "+"}), r.term, h("small", {text: "×" + r.weight}))),
        data.plan.arguments.map((a) => h("span", {class: "chip"}, h("small", {text: "argument"}), a)));
      const status = h("p", {class: "muted"},
        h("span", {class: "pill " + (hybrid ? "info" : ""), id: "ranker", text: hybrid ? "hybrid: BM25 + embeddings" : "BM25"}), " ",
        C.n(data.total_searched) + " tools searched",
        data.note ? h("span", {}, " · ", h("span", {class: "pill warn", text: data.note})) : null,
        !data.embedder ? " · no embedder configured (coffer config embedder_url …)" : null);
      if (!data.results.length) {
        C.replace(this.body, status, reading, panel(empty("No tool matches any word of this request.")));
        return;
      }
      C.replace(this.body, status, reading, h("ol", {class: "plain", id: "search-results"}, data.results.map((r) => this.result(r, best, hybrid))));
    },
    result(r, best, hybrid) {
      const bar = hybrid ? h("div", {class: "score-bar"}, h("i", {data: {w: r.lexical_share / best}}), h("i", {class: "semantic", data: {w: r.semantic_share / best}})) :
        h("div", {class: "score-bar"}, h("i", {data: {w: r.score / best}}));
      for (const piece of bar.children) piece.style.width = Math.max(0, Math.min(100, parseFloat(piece.dataset.w) * 100)).toFixed(1) + "%";
      const rows = r.matches.map((m) => h("tr", {},
        h("td", {class: "mono", text: m.kind === "term" ? m.words.join(" / ") || m.label : m.label}),
        h("td", {class: "muted", text: m.kind === "term" ? (m.label !== m.words.join(" / ") ? "→ " + m.label + " · " : "") + m.how : m.how}),
        h("td", {}, h("span", {class: "fields"}, Object.entries(m.fields).map(([field, count]) =>
          h("span", {class: "chip", text: field + (count > 1 ? " ×" + count : "")})))),
        h("td", {class: "num", text: "+" + m.points.toFixed(3)})));
      return h("li", {class: "panel result", data: {name: r.name, score: r.score}},
        h("div", {class: "result-head"}, h("span", {class: "rank", text: r.rank + "."}),
          h("b", {class: "cap-name", text: r.name}), h("span", {class: "spacer"}),
          h("span", {class: "num score", text: r.score.toFixed(4)})),
        r.description ? h("div", {class: "muted", text: r.description.slice(0, 400)}) : null,
        bar,
        hybrid ? h("p", {class: "muted", text: "BM25 share " + r.lexical_share.toFixed(3) + " (its BM25 score " + r.bm25.toFixed(3) + ") + embedding share " + r.semantic_share.toFixed(3)}) : null,
        r.exact ? null : h("p", {class: "warning", text: "These parts do not add up to the ranker's score: the explanation is out of date with the ranker."}),
        h("table", {class: "explain"}, h("tbody", {}, rows)));
    },
  };

  // -- Knowledge -----------------------------------------------------------------------------------------------
  V.knowledge = {
    title: "Knowledge",
    mount(root) {
      this.seen = {};
      const view = this;
      this.status = h("p", {class: "muted"});
      this.body = h("div", {}, h("p", {class: "muted", text: "Loading…"}));
      this.path = h("input", {type: "text", name: "path", placeholder: "/path/to/a/folder of notes or docs", "aria-label": "Folder"});
      this.name = h("input", {type: "text", name: "name", placeholder: "name (optional)", "aria-label": "Name"});
      this.globs = h("input", {type: "text", name: "globs", placeholder: "files, e.g. **/*.md (optional)", "aria-label": "Files"});
      const add = h("button", {class: "primary", text: "Add folder", id: "knowledge-add", on: {click: async (e) => {
        const globs = view.globs.value.split(",").map((g) => g.trim()).filter(Boolean);
        const done = await C.act(e.target, "knowledge/add", {path: view.path.value, name: view.name.value || null, globs: globs});
        if (done) { view.path.value = view.name.value = view.globs.value = ""; }
      }}});
      root.append(head("Knowledge", this.status), this.body,
        h("h2", {text: "Add a folder"}),
        panel(h("div", {class: "panel-body"}, h("div", {class: "form-row"}, this.path, this.name, this.globs, add),
          h("p", {class: "muted", text: "Agents search it with coffer__ask. It is indexed now and watched for changes."}))));
    },
    async load() {
      const data = await C.get("knowledge");
      if (!changed(this, "knowledge", data)) return;
      C.replace(this.status, "memory notes " + (data.memory ? "on" : "off") + " · ",
        data.embedder ? "embeddings: " + data.embedder : "no embedder: answers are lexical (coffer config embedder_url …)");
      if (!data.sources.length) {
        C.replace(this.body, panel(empty("No knowledge sources yet: add a folder below.")));
        return;
      }
      const skipped = (s) => Object.entries(s.skipped || {}).map(([why, n]) => n + " " + why).join(", ");
      C.replace(this.body, h("div", {class: "toolbar"}, h("span", {class: "spacer"}),
        h("button", {class: "small", text: "Reindex all", on: {click: (e) => C.act(e.target, "knowledge/reindex", {})}})),
        panel(h("div", {class: "table-wrap"}, h("table", {id: "knowledge-table"},
          h("thead", {}, h("tr", {}, ["Source", "Folder", "Files", "Passages", "Vectors ready", "Last indexed", ""].map((text, i) =>
            h("th", {class: i >= 2 && i <= 4 ? "num" : "", text: text})))),
          h("tbody", {}, data.sources.map((s) => h("tr", {data: {source: s.name}},
            h("td", {}, h("b", {text: s.name}), " ", s.kind === "memory" ? h("span", {class: "pill info", text: "memory"}) : null),
            h("td", {}, h("span", {class: "mono", text: s.root}), h("span", {class: "sub", text: s.globs.join(" ") + (skipped(s) ? " · skipped: " + skipped(s) : "")})),
            h("td", {class: "num", text: C.n(s.files)}), h("td", {class: "num", text: C.n(s.passages)}),
            h("td", {class: "num", text: s.vectors === null ? "–" : C.n(s.vectors) + " / " + C.n(s.passages)}),
            h("td", {class: "nowrap", title: C.local(s.indexed_at), text: C.when(s.indexed_at)}),
            h("td", {class: "nowrap"}, h("button", {class: "small", text: "Reindex", on: {click: (e) => C.act(e.target, "knowledge/reindex", {name: s.name})}}), " ",
              s.kind === "memory" ? null : C.confirmButton("Remove", "Remove " + s.name + "?", (b) => C.act(b, "knowledge/remove", {name: s.name}))))))))));
    },
  };

  // -- Sessions and profiles -----------------------------------------------------------------------------------
  V.sessions = {
    title: "Sessions",
    mount(root) {
      this.seen = {};
      this.body = h("div", {}, h("p", {class: "muted", text: "Loading…"}));
      this.profiles = h("div", {});
      root.append(head("Sessions", h("p", {class: "muted", text: "The agents connected to this Coffer now."})), this.body,
        h("h2", {text: "Profiles"}), this.profiles);
    },
    async load() {
      const data = await C.get("sessions");
      if (!changed(this, "sessions", data)) return;
      C.replace(this.body, panel(data.sessions.length ? h("div", {class: "table-wrap"}, h("table", {id: "sessions-table"},
        h("thead", {}, h("tr", {}, ["Client", "Profile", "Protocol", "Connected", "Calls", "Servers used"].map((text) => h("th", {text: text})))),
        h("tbody", {}, data.sessions.map((s) => h("tr", {},
          h("td", {}, h("b", {text: s.client}), s.version ? h("span", {class: "sub", text: "version " + s.version}) : null),
          h("td", {}, s.profile ? h("span", {class: "pill", text: s.profile}) : h("span", {class: "muted", text: "none: every tool"})),
          h("td", {text: s.era === "modern" ? "2026-07-28" : s.era ? "handshake (2024–2025)" : "starting"}),
          h("td", {class: "nowrap", title: C.local(s.since), text: C.when(s.since)}),
          h("td", {class: "num", text: C.n(s.calls)}),
          h("td", {}, s.servers.length ? s.servers.map((name) => h("span", {class: "pill", text: name + (s.own_instances.includes(name) ? " (own)" : "")})) :
            h("span", {class: "muted", text: "none yet"})))))))
        : empty("No agent is connected. An agent connects when it starts `coffer serve`.")));
      C.replace(this.profiles, panel(data.profiles.length ? h("div", {class: "table-wrap"}, h("table", {id: "profiles-table"},
        h("thead", {}, h("tr", {}, ["Profile", "Includes", "Leaves out", "Tools", "Connected clients"].map((text) => h("th", {text: text})))),
        h("tbody", {}, data.profiles.map((p) => h("tr", {data: {profile: p.name}},
          h("td", {}, h("b", {text: p.name}), p.expose ? h("span", {class: "sub", text: "listed: " + p.expose}) : null),
          h("td", {class: "mono", text: p.include.join(" ")}),
          h("td", {class: "mono", text: p.exclude.join(" ")}),
          h("td", {class: "num", text: C.n(p.tools)}),
          h("td", {}, p.clients.length ? p.clients.map((name) => h("span", {class: "pill", text: name})) : h("span", {class: "muted", text: "none now"})))))))
        : empty("No profiles: every agent sees every tool. `coffer profile add NAME --include …` gives one kind of agent fewer.")));
    },
  };
})();
