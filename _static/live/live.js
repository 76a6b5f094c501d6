/* The "Try it" page: the dates model, exported to ONNX, translating in the reader's browser.
 *
 * Loaded only on the page that holds <div id="live-dates"> (docs/_ext/live_model.py).
 * Nothing heavy is fetched until the reader presses the start button: then
 * onnxruntime-web (its WebAssembly build, from _static/live/ort/), the two graphs and
 * tokenizer.json (from _static/live/model/, exported at build time from the package).
 *
 * The decoding loop is chapter 9's greedy loop, as transformer_book.export.onnx_greedy_decode
 * runs it in Python: encode once, then run the decoder on the prefix padded to its fixed
 * length, take the argmax at the prefix's last position, stop at <eos> or max_len.
 * tests/test_live.py checks the tokens against tb.greedy_decode and the heatmap against PyTorch.
 */
(function () {
  "use strict";
  const BASE = new URL(".", document.currentScript.src).href; // .../_static/live/
  const state = { spec: null, encoder: null, decoder: null, view: null, head: 1, last: null, timings: {} };
  window.liveDates = state;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    node.append(...children);
    return node;
  }

  function loadScript(src) {
    return new Promise((resolve, reject) => {
      const script = el("script", { src: src });
      script.onload = resolve;
      script.onerror = () => reject(new Error("could not load " + src));
      document.head.appendChild(script);
    });
  }

  // ------------------------------------------------------------------ the page's parts

  function build(root) {
    root.replaceChildren();
    const start = el("button", { type: "button", id: "live-start", class: "live-button", text: "Start the model" });
    const status = el("p", { id: "live-status", class: "live-status", "aria-live": "polite",
      text: "Nothing is loaded yet: the button fetches onnxruntime-web and the model, once." });
    const input = el("input", { type: "text", id: "live-input", class: "live-input", disabled: "",
      "aria-label": "A date in French words", placeholder: "vingt-trois novembre deux mille vingt-six",
      autocomplete: "off", spellcheck: "false" });
    const go = el("button", { type: "button", id: "live-translate", class: "live-button", disabled: "", text: "Translate" });
    const examples = el("div", { id: "live-examples", class: "live-examples" });
    const message = el("div", { id: "live-message", class: "live-message", role: "alert", hidden: "" });
    const iso = el("p", { id: "live-iso", class: "live-iso" });
    const steps = el("div", { id: "live-steps", class: "live-steps" });
    const heatmap = el("div", { id: "live-heatmap", class: "live-heatmap" });
    root.append(el("div", { class: "live-row" }, start, status),
      el("div", { class: "live-row" }, input, go), examples, message, iso, steps, heatmap);
    root.dataset.state = "idle";
    root.dataset.translations = "0";
    start.addEventListener("click", () => startModel(root));
    go.addEventListener("click", () => translate(root, input.value));
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") translate(root, input.value);
    });
  }

  async function startModel(root) {
    const $ = (id) => root.querySelector("#" + id);
    const t0 = performance.now();
    state.timings = { start: t0 };
    $("live-start").disabled = true;
    root.dataset.state = "loading";
    $("live-status").textContent = "Loading onnxruntime-web and the model…";
    try {
      await loadScript(BASE + "ort/ort.wasm.min.js");
      ort.env.wasm.wasmPaths = BASE + "ort/";
      ort.env.wasm.numThreads = 1; // threads need cross-origin isolation, which a static site lacks
      ort.env.logLevel = "error";
      const response = await fetch(BASE + "model/tokenizer.json");
      if (!response.ok) throw new Error("tokenizer.json: HTTP " + response.status);
      state.spec = await response.json();
      const options = { executionProviders: ["wasm"], graphOptimizationLevel: "all" };
      [state.encoder, state.decoder] = await Promise.all([
        ort.InferenceSession.create(BASE + "model/encoder.onnx", options),
        ort.InferenceSession.create(BASE + "model/decoder.onnx", options),
      ]);
    } catch (error) {
      root.dataset.state = "failed";
      showMessage(root, "The model could not be loaded in this browser: " + error.message);
      $("live-status").textContent = "";
      return;
    }
    state.timings.loaded = performance.now();
    const bytes = performance.getEntriesByType("resource")
      .filter((entry) => entry.name.startsWith(BASE + "ort/") || entry.name.startsWith(BASE + "model/"))
      .reduce((sum, entry) => sum + (entry.decodedBodySize || 0), 0);
    $("live-status").textContent = `Loaded ${(bytes / 1e6).toFixed(1)} MB in ${((state.timings.loaded - t0) / 1000).toFixed(2)} s. `
      + `Model: ${state.spec.num_layers} + ${state.spec.num_layers} layers, d_model ${state.spec.d_model}, `
      + `${state.spec.num_heads} heads; trained ${state.spec.steps} steps, ${(100 * state.spec.accuracy).toFixed(1)}% exact on held-out dates.`;
    for (const text of state.spec.examples) {
      const chip = el("button", { type: "button", class: "live-example", text: text });
      chip.addEventListener("click", () => {
        $("live-input").value = text;
        translate(root, text);
      });
      $("live-examples").append(chip);
    }
    $("live-input").disabled = false;
    $("live-translate").disabled = false;
    if (!$("live-input").value) $("live-input").value = state.spec.examples[0];
    await translate(root, $("live-input").value);
    state.timings.firstTranslation = performance.now();
    state.timings.startToFirstMs = state.timings.firstTranslation - t0;
  }

  // ------------------------------------------------------------------ reading the input

  /** The source ids of `text`, or a message saying why the model cannot read it. */
  function readSource(text) {
    const spec = state.spec;
    const words = text.split(new RegExp(spec.source_split)).filter((w) => w.length > 0);
    const example = spec.examples[0];
    if (words.length === 0) {
      return { error: `Type a date in French words, for example “${example}”.` };
    }
    const known = new Set(spec.source_tokens.slice(3)); // ids 0-2 are <pad>, <bos>, <eos>
    const unknown = [...new Set(words.filter((w) => !known.has(w)))];
    if (unknown.length) {
      const hints = unknown.filter((w) => known.has(w.toLowerCase()))
        .map((w) => ` (the model knows “${w.toLowerCase()}”, in lower case)`);
      return {
        error: `The model does not know ${unknown.length === 1 ? "the word" : "the words"} `
          + unknown.map((w) => `“${w}”`).join(", ") + (hints.length ? hints.join("") : "") + ". "
          + `It reads only the ${known.size} words that spell the dates from ${spec.first_year} to ${spec.last_year}: `
          + [...known].join(", ") + ".",
      };
    }
    if (words.length > spec.src_len) {
      return {
        error: `That is ${words.length} words; the model reads at most ${spec.src_len}, `
          + `the length of the longest date it was trained on.`,
      };
    }
    return { words: words, ids: words.map((w) => spec.source_tokens.indexOf(w)) };
  }

  // ------------------------------------------------------------------ the decoding loop

  function int64(values, length, pad) {
    const data = new BigInt64Array(length).fill(BigInt(pad));
    values.forEach((v, i) => { data[i] = BigInt(v); });
    return new ort.Tensor("int64", data, [1, length]);
  }

  async function greedy(ids) {
    const spec = state.spec;
    const src = int64(ids, spec.src_len, spec.pad_id);
    const { memory } = await state.encoder.run({ src: src });
    const ys = [spec.bos_id];
    const steps = [];
    let attention = null;
    while (ys.length < spec.max_len) {
      const tgt = int64(ys, spec.decoder_len, spec.pad_id);
      const out = await state.decoder.run({ memory: memory, src: src, tgt: tgt });
      const vocab = out.logits.dims[2];
      const logits = Array.from(out.logits.data.subarray((ys.length - 1) * vocab, ys.length * vocab));
      const top = Math.max(...logits);
      const exp = logits.map((x) => Math.exp(x - top));
      const total = exp.reduce((a, b) => a + b, 0);
      const probs = exp.map((x) => x / total);
      const next = logits.indexOf(top); // the first maximum, as torch.argmax
      steps.push({ prefix: ys.slice(), probs: probs, choice: next });
      ys.push(next);
      attention = out.cross_attention;
      if (next === spec.eos_id) break;
    }
    // Cross-attention of the last layer at the last step: row t is the query that chose ys[t + 1].
    const [, heads, rows, cols] = attention.dims;
    const weights = [];
    for (let h = 0; h < heads; h++) {
      for (let t = 0; t < ys.length - 1; t++) {
        for (let j = 0; j < ids.length; j++) {
          weights.push({ h: h, t: t, j: j, w: attention.data[((h * rows) + t) * cols + j] });
        }
      }
    }
    return { ids: ys, steps: steps, weights: weights };
  }

  // ------------------------------------------------------------------ showing the result

  function showMessage(root, text) {
    const box = root.querySelector("#live-message");
    box.textContent = text;
    box.hidden = !text;
  }

  function tokenText(id) {
    return state.spec.target_tokens[id];
  }

  function stepsTable(steps) {
    const head = el("tr", {}, ...["step", "prefix", "top 1", "top 2", "top 3"].map((h) => el("th", { text: h })));
    const rows = steps.map((step, index) => {
      const ranked = step.probs.map((p, id) => [p, id]).sort((a, b) => b[0] - a[0]).slice(0, 3);
      const prefix = step.prefix.slice(1).map(tokenText).join("") || "(only <bos>)";
      return el("tr", {}, el("td", { text: String(index + 1) }), el("td", { class: "live-mono", text: prefix }),
        ...ranked.map(([p, id]) => el("td", { class: id === step.choice ? "live-mono live-chosen" : "live-mono",
          text: `${tokenText(id)}  ${p.toFixed(4)}` })));
    });
    return el("table", { class: "live-table" }, el("thead", {}, head), el("tbody", {}, ...rows));
  }

  async function drawHeatmap(root, words, result) {
    const spec = state.spec;
    const outputs = result.ids.slice(1);
    const values = result.weights.map((r) => ({
      head: r.h + 1,
      step: r.t + 1,
      position: r.j + 1,
      output: `${r.t + 1}: ${tokenText(outputs[r.t])}`,
      source: `${r.j + 1}: ${words[r.j]}`,
      weight: r.w,
    }));
    const heads = Array.from({ length: spec.num_heads }, (_, i) => i + 1);
    const chart = {
      // The book's own Vega-Lite (loaded on every page); the schema names its major version, fetches nothing.
      $schema: `https://vega.github.io/schema/vega-lite/v${vegaLite.version.split(".")[0]}.json`,
      title: `Cross-attention of the last decoder layer (layer ${spec.num_layers})`,
      data: { name: "weights", values: values },
      params: [{ name: "head", value: state.head, bind: { input: "select", options: heads, name: "head " } }],
      transform: [{ filter: "datum.head == head" }],
      mark: "rect",
      encoding: {
        x: { field: "source", type: "ordinal", sort: { field: "position" }, title: "source word", axis: { labelAngle: -40 } },
        y: { field: "output", type: "ordinal", sort: { field: "step" }, title: "output token (decoding step: token)" },
        color: { field: "weight", type: "quantitative", scale: { domain: [0, 1], scheme: "blues" }, title: "weight" },
        tooltip: [{ field: "output" }, { field: "source" }, { field: "head" }, { field: "weight", format: ".4f" }],
      },
      width: Math.max(220, 40 * words.length),
      height: 24 * outputs.length,
    };
    const target = root.querySelector("#live-heatmap");
    if (state.view) state.view.finalize();
    const embedded = await vegaEmbed(target, chart, { actions: false, renderer: "svg" });
    state.view = embedded.view;
    state.view.addSignalListener("head", (name, value) => { state.head = value; });
  }

  async function translate(root, text) {
    if (!state.spec || root.dataset.state === "busy") return;
    const $ = (id) => root.querySelector("#" + id);
    const read = readSource(text);
    if (read.error) {
      showMessage(root, read.error);
      root.classList.add("live-stale"); // the translation still shown is of an earlier input
      root.dataset.state = "rejected";
      root.dataset.translations = String(Number(root.dataset.translations) + 1);
      return;
    }
    root.dataset.state = "busy";
    showMessage(root, "");
    try {
      const result = await greedy(read.ids);
      const iso = result.ids.slice(1).filter((id) => id !== state.spec.eos_id).map(tokenText).join("");
      $("live-iso").replaceChildren("“" + read.words.join(" ") + "” → ", el("code", { text: iso }));
      $("live-iso").dataset.ids = JSON.stringify(result.ids);
      $("live-iso").dataset.source = JSON.stringify(read.ids);
      $("live-steps").replaceChildren(stepsTable(result.steps));
      await drawHeatmap(root, read.words, result);
      state.last = { text: text, words: read.words, source: read.ids, ids: result.ids, iso: iso };
      root.classList.remove("live-stale");
      root.dataset.state = "done";
    } catch (error) {
      showMessage(root, "The model failed on this input: " + error.message);
      root.dataset.state = "failed";
    }
    root.dataset.translations = String(Number(root.dataset.translations) + 1);
  }

  function init() {
    const root = document.getElementById("live-dates");
    if (root) build(root);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
