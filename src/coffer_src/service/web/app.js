// Coffer's page: the frame (navigation, header, polling, talking to the service) and the helpers the views use.
// Plain DOM, no framework: every text goes in through textContent, never as HTML, so nothing a server or a tool
// definition says can run as code here (the Content-Security-Policy forbids inline script besides).
"use strict";
(function () {
  const C = window.Coffer = window.Coffer || {};
  const KEY = "coffer-key";
  const POLL_MS = 2500;

  // -- building the page ---------------------------------------------------------------------------------------
  // h("div", {class: "x", on: {click: fn}, data: {id: 1}}, "text", child, [more]) -> an element.
  C.h = function h(tag, attrs, ...children) {
    const svg = tag.startsWith("svg:");
    const el = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4)) : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "on") {
        for (const [event, fn] of Object.entries(value)) el.addEventListener(event, fn);
      } else if (name === "data") {
        for (const [k, v] of Object.entries(value)) el.dataset[k] = v;
      } else if (name === "text") {
        el.textContent = value;
      } else if (name === "class" && !svg) {
        el.className = value;
      } else if (!svg && (name === "value" || name === "checked" || name === "disabled" || name === "hidden")) {
        el[name] = value;
      } else {
        el.setAttribute(name, value === true ? "" : String(value));
      }
    }
    append(el, children);
    return el;
  };
  function append(el, children) {
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      if (Array.isArray(child)) append(el, child);
      else el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  C.clear = function (el) { while (el.firstChild) el.removeChild(el.firstChild); return el; };
  C.replace = function (el, ...children) { C.clear(el); append(el, children); return el; };

  // -- formatting ----------------------------------------------------------------------------------------------
  const numbers = new Intl.NumberFormat();
  C.n = (value) => (value === null || value === undefined ? "–" : numbers.format(value));
  C.ms = function (value) {
    if (value === null || value === undefined) return "–";
    if (value < 1) return value.toFixed(2) + " ms";
    if (value < 1000) return Math.round(value) + " ms";
    return (value / 1000).toFixed(value < 10000 ? 2 : 1) + " s";
  };
  C.pct = (value) => (value === null || value === undefined ? "–" : (value * 100).toFixed(value < 0.1 ? 1 : 0) + "%");
  C.mb = (value) => (value === null || value === undefined ? "–" : value.toFixed(value < 100 ? 1 : 0) + " MB");
  C.when = function (iso) {
    if (!iso) return "never";
    const then = new Date(iso), seconds = (Date.now() - then.getTime()) / 1000;
    if (isNaN(seconds)) return iso;
    if (seconds < 45) return "just now";
    if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
    if (seconds < 86400) return Math.round(seconds / 3600) + " h ago";
    if (seconds < 86400 * 14) return Math.round(seconds / 86400) + " days ago";
    return then.toLocaleDateString();
  };
  C.local = (iso) => (iso ? new Date(iso).toLocaleString() : "");
  C.duration = function (seconds) {
    const s = Math.floor(seconds), d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
    return d ? d + "d " + h + "h" : h ? h + "h " + m + "m" : m ? m + "m" : s + "s";
  };

  // -- talking to the service ----------------------------------------------------------------------------------
  C.lost = false;
  C.api = async function (path, options) {
    const headers = {"X-Coffer-Token": window.localStorage.getItem(KEY) || ""};
    if (options && options.body) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, Object.assign({headers: headers, credentials: "same-origin", cache: "no-store"}, options || {}));
    } catch (error) {
      setLive(false, "The Coffer service does not answer: it stopped, or was replaced by a newer one. Run `coffer open` to reconnect.");
      throw error;
    }
    const text = await response.text();
    let body;
    try { body = JSON.parse(text); } catch (error) { body = {error: text.slice(0, 200)}; }
    if (response.status === 401 || (response.status === 403 && body.code === "csrf")) {
      setLive(false, "Signed out: run `coffer open` in a terminal for a new login link.");
      throw new Error(body.error || "signed out");
    }
    setLive(true);
    if (!response.ok) throw new Error(body.error || ("HTTP " + response.status));
    body._text = text;
    return body;
  };
  C.get = (name, params) => {
    const query = new URLSearchParams();
    for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined && v !== "") query.set(k, v);
    const suffix = query.toString();
    return C.api("/api/" + name + (suffix ? "?" + suffix : ""));
  };
  C.post = (name, body) => C.api("/api/" + name, {method: "POST", body: JSON.stringify(body || {})});

  // A change from the page: the button shows it is busy, the answer (or the error) comes as a toast, and the view
  // reloads at once so the page shows what the service now does.
  C.act = async function (button, name, body) {
    if (button && button.classList.contains("busy")) return null;
    if (button) { button.classList.add("busy"); button.disabled = true; }
    try {
      const result = await C.post(name, body);
      C.toast(result.message || "done");
      return result;
    } catch (error) {
      C.toast(error.message, "bad");
      return null;
    } finally {
      if (button) { button.classList.remove("busy"); button.disabled = false; }
      refresh(true);
    }
  };

  // A button that asks once more before a change that cannot be undone from the page.
  C.confirmButton = function (label, armedLabel, onConfirm) {
    const button = C.h("button", {class: "danger small", text: label});
    let timer = null;
    button.addEventListener("click", function () {
      if (!button.classList.contains("armed")) {
        button.classList.add("armed");
        button.textContent = armedLabel;
        timer = setTimeout(() => { button.classList.remove("armed"); button.textContent = label; }, 4000);
        return;
      }
      clearTimeout(timer);
      button.classList.remove("armed");
      button.textContent = label;
      onConfirm(button);
    });
    return button;
  };

  C.toast = function (text, kind) {
    const toast = C.h("div", {class: "toast" + (kind ? " " + kind : ""), text: text});
    document.getElementById("toasts").appendChild(toast);
    setTimeout(() => toast.remove(), kind === "bad" ? 8000 : 4000);
  };

  function setLive(ok, problem) {
    const live = document.getElementById("live"), banner = document.getElementById("banner");
    C.lost = !ok;
    live.className = "live " + (ok ? "ok" : "lost");
    live.textContent = ok ? "live" : "disconnected";
    banner.hidden = ok;
    if (!ok) banner.textContent = problem;
  }

  // -- navigation ----------------------------------------------------------------------------------------------
  C.views = C.views || {};
  let current = null, currentName = null, readyMarked = false;

  C.params = function () {
    const hash = window.location.hash.replace(/^#\/?/, "");
    const [name, query] = hash.split("?");
    return {name: name || "servers", query: new URLSearchParams(query || "")};
  };
  // Keep a view's filters in the address (so a reload or a bookmark keeps them) without filling the history.
  C.setQuery = function (values) {
    const params = C.params();
    for (const [k, v] of Object.entries(values)) {
      if (v === null || v === undefined || v === "") params.query.delete(k); else params.query.set(k, v);
    }
    const suffix = params.query.toString();
    window.history.replaceState(null, "", "#/" + params.name + (suffix ? "?" + suffix : ""));
  };
  C.go = (hash) => { window.location.hash = hash; };

  function route() {
    const params = C.params();
    const view = C.views[params.name] || C.views.servers;
    const name = C.views[params.name] ? params.name : "servers";
    for (const link of document.querySelectorAll("#nav a")) link.classList.toggle("active", link.dataset.view === name);
    if (current && currentName === name && current.update) {
      current.update(params.query);
      return;
    }
    if (current && current.unmount) current.unmount();
    const main = C.clear(document.getElementById("main"));
    current = view;
    currentName = name;
    document.title = "Coffer · " + (view.title || name);
    view.mount(main, params.query);
    load();
  }

  async function load(force) {
    const view = current;
    if (!view || !view.load) return;
    try {
      await view.load(force);
      if (!readyMarked) {
        readyMarked = true;
        performance.mark("coffer-ready");   // the first view's data is on screen (the browser test reads it)
      }
    } catch (error) {
      if (!C.lost) C.toast(error.message, "bad");
    }
  }

  async function header() {
    try {
      const o = await C.get("overview");
      const s = o.service;
      document.getElementById("service").textContent =
        "Coffer " + s.version + " · pid " + s.pid + " · up " + C.duration(s.uptime_s) + (s.rss_mb ? " · " + C.mb(s.rss_mb) : "");
      document.getElementById("badge-servers").textContent = o.failed ? o.failed : "";
      document.getElementById("badge-changes").textContent = o.changed ? o.changed : "";
      document.getElementById("badge-catalogue").textContent = o.tools ? C.n(o.tools) : "";
      document.getElementById("badge-sessions").textContent = o.sessions ? o.sessions : "";
    } catch (error) { /* the banner says what is wrong */ }
  }

  function refresh(force) {
    header();
    load(force);
  }
  C.refresh = refresh;

  function tick() {
    if (document.visibilityState !== "visible") return;
    if (current && current.poll === false && !C.lost) { header(); return; }
    refresh(false);
  }

  document.addEventListener("keydown", function (event) {
    const typing = /^(INPUT|SELECT|TEXTAREA)$/.test(document.activeElement && document.activeElement.tagName);
    if (event.key === "/" && !typing) {
      const box = document.querySelector("main input[type=search], main input[type=text]");
      if (box) { event.preventDefault(); box.focus(); box.select(); }
    }
  });
  window.addEventListener("hashchange", route);
  document.addEventListener("visibilitychange", tick);
  route();
  header();
  setInterval(tick, POLL_MS);
})();
