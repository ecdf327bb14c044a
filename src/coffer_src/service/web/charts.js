// Charts drawn as inline SVG: stacked bars per hour and lines per hour.  Every hour has a hover target carrying
// its numbers (data-hour, data-total) and a tooltip, so what is drawn can be read back exactly.
"use strict";
(function () {
  const C = window.Coffer = window.Coffer || {};
  const W = 760, H = 190, LEFT = 44, RIGHT = 8, TOP = 8, BOTTOM = 22;

  function s(tag, attrs, ...children) { return C.h("svg:" + tag, attrs, ...children); }

  // A "nice" top for the y axis (1, 2, 2.5, 5 x 10^n) at or above the largest value.
  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  function hourLabel(iso, week) {
    const date = new Date(iso);
    if (week) return date.toLocaleDateString(undefined, {weekday: "short", day: "numeric"});
    return date.toLocaleTimeString(undefined, {hour: "2-digit", minute: "2-digit"});
  }

  function frame(svg, hours, top, format) {
    const plotH = H - TOP - BOTTOM, week = hours.length > 48;
    for (const fraction of [0, 0.5, 1]) {
      const y = TOP + plotH * (1 - fraction);
      svg.appendChild(s("line", {class: fraction ? "grid" : "axis", x1: LEFT, x2: W - RIGHT, y1: y, y2: y}));
      svg.appendChild(s("text", {x: LEFT - 6, y: y + 3, "text-anchor": "end", text: format(top * fraction)}));
    }
    const slot = (W - LEFT - RIGHT) / hours.length;
    const every = week ? 24 : 3;
    hours.forEach(function (hour, i) {
      const date = new Date(hour);
      const mark = week ? date.getHours() === 0 : date.getHours() % every === 0;
      if (mark) {
        svg.appendChild(s("text", {x: LEFT + slot * i + (week ? 2 : slot / 2), y: H - 6,
          "text-anchor": week ? "start" : "middle", text: hourLabel(hour, week)}));
      }
    });
    return slot;
  }

  function tooltip(hour, lines) {
    const start = new Date(hour), end = new Date(start.getTime() + 3600 * 1000);
    const range = start.toLocaleString(undefined, {weekday: "short", hour: "2-digit", minute: "2-digit"}) + "–" +
      end.toLocaleTimeString(undefined, {hour: "2-digit", minute: "2-digit"});
    return s("title", {text: [range].concat(lines).join("\n")});
  }

  // Stacked bars: opts.hours (ISO), opts.series [{name, values, cls}], opts.format(value), opts.unit, opts.chart.
  C.barChart = function (opts) {
    const hours = opts.hours, series = opts.series;
    const totals = hours.map((_, i) => series.reduce((sum, one) => sum + (one.values[i] || 0), 0));
    const top = opts.max !== undefined ? opts.max : niceMax(Math.max(0, ...totals));
    const svg = s("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": opts.label, data: {chart: opts.chart}});
    const slot = frame(svg, hours, top, opts.axis || opts.format);
    const plotH = H - TOP - BOTTOM, gap = slot > 6 ? 1.5 : 0.5;
    hours.forEach(function (hour, i) {
      let base = TOP + plotH;
      series.forEach(function (one) {
        const value = one.values[i] || 0;
        if (!value) return;
        const height = plotH * value / top;
        base -= height;
        svg.appendChild(s("rect", {class: "bar " + one.cls, x: LEFT + slot * i + gap / 2, y: base,
          width: Math.max(0.5, slot - gap), height: height, data: {hour: hour, series: one.name, value: value}}));
      });
      const lines = series.filter((one) => one.values[i]).map((one) => one.name + ": " + opts.format(one.values[i]));
      svg.appendChild(s("rect", {class: "hit", x: LEFT + slot * i, y: TOP, width: slot, height: plotH,
        data: {hour: hour, total: totals[i]}},
        tooltip(hour, lines.length ? lines.concat(series.length > 1 ? ["total: " + opts.format(totals[i])] : []) : ["none"])));
    });
    return svg;
  };

  // Lines with a dot per hour that has a value (an hour without calls has none: the line breaks there).
  C.lineChart = function (opts) {
    const hours = opts.hours, lines = opts.lines;
    const all = [].concat(...lines.map((line) => line.values.filter((v) => v !== null && v !== undefined)));
    const top = niceMax(Math.max(0, ...all));
    const svg = s("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": opts.label, data: {chart: opts.chart}});
    const slot = frame(svg, hours, top, opts.format);
    const plotH = H - TOP - BOTTOM;
    const y = (value) => TOP + plotH * (1 - value / top);
    lines.forEach(function (line) {
      let path = "", open = false;
      line.values.forEach(function (value, i) {
        if (value === null || value === undefined) { open = false; return; }
        const x = LEFT + slot * i + slot / 2;
        path += (open ? "L" : "M") + x.toFixed(1) + " " + y(value).toFixed(1);
        open = true;
        svg.appendChild(s("circle", {class: "dot " + line.cls, cx: x, cy: y(value), r: hours.length > 48 ? 1.4 : 2.4,
          data: {hour: hours[i], series: line.name, value: value}}));
      });
      if (path) svg.insertBefore(s("path", {class: "line " + line.cls, d: path}), svg.firstChild.nextSibling);
    });
    hours.forEach(function (hour, i) {
      const text = lines.filter((line) => line.values[i] !== null && line.values[i] !== undefined)
        .map((line) => line.name + ": " + opts.format(line.values[i]));
      svg.appendChild(s("rect", {class: "hit", x: LEFT + slot * i, y: TOP, width: slot, height: plotH,
        data: {hour: hour}}, tooltip(hour, text.length ? text : ["no calls"])));
    });
    return svg;
  };

  C.legend = function (items) {
    return C.h("span", {class: "legend"}, items.map((item) => C.h("span", {class: item.cls, text: item.name})));
  };
})();
