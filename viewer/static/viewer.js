// stalewise view: colour token spans by a channel and show a token's fields on hover.
// Untrusted text only ever reaches the page through textContent, never innerHTML.
"use strict";
(function () {  // the trajectories table: a changed drop-down applies the filters at once
  document.querySelectorAll("form.filters select").forEach(function (select) {
    select.addEventListener("change", function () { select.form.submit(); });
  });
})();
(function () {
  const block = document.getElementById("token-data");
  const select = document.getElementById("channel");
  if (!block || !select) return;
  const data = JSON.parse(block.textContent);
  const spans = document.querySelectorAll(".tokens span.t");
  const legend = document.getElementById("legend");
  const card = document.getElementById("card");
  const PALETTE = ["#cfe8ff", "#ffe0b3", "#d6f5d6", "#f5d6eb", "#e6e0ff", "#fff6b3",
                   "#d9f2f2", "#f2d9d9"];

  function clamp(x) { return Math.max(0, Math.min(1, x)); }
  // 0 = good (white) .. 1 = bad (red)
  function heat(x) { return "hsl(0, 85%, " + (100 - 45 * clamp(x)).toFixed(0) + "%)"; }
  function diverging(x) {  // negative blue, positive red, |x| >= 1 saturated
    const hue = x < 0 ? 215 : 0;
    return "hsl(" + hue + ", 85%, " + (100 - 45 * clamp(Math.abs(x))).toFixed(0) + "%)";
  }
  function range(values) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) { if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); } }
    return [lo, hi];
  }

  const channels = {
    lp: { colour: (v) => heat(-v / 5), legend: "white: log-prob 0 · red: ≤ −5" },
    tlp: { colour: (v) => heat(-v / 5), legend: "white: log-prob 0 · red: ≤ −5" },
    ratio: { colour: diverging, legend: "blue: trainer below sampler · red: above · saturates at ±1" },
    v: { colour: (v) => PALETTE[((v % PALETTE.length) + PALETTE.length) % PALETTE.length],
         legend: "one colour per version" },
    kv: { colour: (v) => PALETTE[((v % PALETTE.length) + PALETTE.length) % PALETTE.length],
          legend: "one colour per version" },
    t: { colour: null, legend: "" },
  };

  function paint(name) {
    const values = data[name];
    const spec = channels[name];
    let colour = spec.colour;
    let text = spec.legend;
    if (name === "t") {
      const [lo, hi] = range(values);
      colour = (v) => heat(hi > lo ? (v - lo) / (hi - lo) : 0);
      text = "white: " + (isFinite(lo) ? lo.toFixed(3) : "–") + " s · red: " +
             (isFinite(hi) ? hi.toFixed(3) : "–") + " s";
    }
    spans.forEach(function (span) {
      const v = values[Number(span.dataset.i)];
      span.style.backgroundColor = v === null || v === undefined ? "#eeeeee" : colour(v);
    });
    legend.textContent = text;
    document.body.dataset.channel = name;
  }

  function fmt(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits); }

  function show(span, event) {
    const i = Number(span.dataset.i);
    card.textContent = "";
    const lines = [
      "token " + data.id[i] + " " + JSON.stringify(data.text[i]),
      "sampler log-prob " + fmt(data.lp[i], 4),
      "trainer log-prob " + fmt(data.tlp[i], 4) + " · log-ratio " + fmt(data.ratio[i], 4),
      "weights v" + data.v[i] + " · KV v" + data.kv[i],
      "t " + fmt(data.t[i], 4) + " s since request start",
      data.mask[i] ? "trained (loss mask 1)" : "not trained (loss mask 0)",
    ];
    for (const line of lines) {
      const div = document.createElement("div");
      div.textContent = line;
      card.appendChild(div);
    }
    if (data.k[i].length) {
      const head = document.createElement("div");
      head.className = "khead";
      head.textContent = "top-" + data.k[i].length + " of the sampler";
      card.appendChild(head);
      for (const [id, text, lp] of data.k[i]) {
        const div = document.createElement("div");
        div.textContent = fmt(lp, 4) + "  " + id + " " + JSON.stringify(text);
        card.appendChild(div);
      }
    }
    card.hidden = false;
    card.style.left = Math.min(event.pageX + 12, window.innerWidth + window.scrollX - 340) + "px";
    card.style.top = event.pageY + 14 + "px";
  }

  document.addEventListener("mouseover", function (event) {
    const span = event.target.closest ? event.target.closest("span.t") : null;
    if (span) show(span, event); else card.hidden = true;
  });
  select.addEventListener("change", function () { paint(select.value); });
  paint(select.value);
})();
