// depthsat book: math typeset wherever it appears. Sphinx loads MathJax only on pages whose own body has
// math, but the sidebar (a chapter title with math) and the search results (summaries built from the
// pages' text, TeX still between \( and \)) show math on other pages too: there MathJax, served by the
// site itself, is loaded here, and search results are typeset as they arrive.
(function () {
  "use strict";
  var waiting = [];
  // (balance is hoisted: defined below)
  function typeset(el) {
    var mj = window.MathJax;
    if (mj && mj.typesetPromise) {
      el.querySelectorAll("p.context").forEach(balance);
      mj.typesetPromise([el]).catch(function () {});
      return;
    }
    waiting.push(el);
    if (document.getElementById("depthsat-mathjax") || document.querySelector('script[src*="mathjax/tex-chtml.js"]')) return;
    window.MathJax = {
      startup: {
        typeset: false,
        pageReady: function () {
          return window.MathJax.startup.defaultPageReady().then(function () {
            waiting.forEach(function (el) {
              el.querySelectorAll("p.context").forEach(balance);
            });
            return window.MathJax.typesetPromise(waiting);
          });
        },
      },
    };
    var root = document.documentElement.dataset.content_root || "";
    var script = document.createElement("script");
    script.id = "depthsat-mathjax";
    script.async = true;
    script.src = root + "_static/mathjax/tex-chtml.js";
    document.head.appendChild(script);
  }
  // A summary is a window of the page's text: it may start inside a formula (a closing delimiter
  // first) or end inside one (an opening delimiter last). Cut such fragments so that every formula
  // left in the summary is whole and typesets.
  function balance(p) {
    if (p.dataset.depthsatBalanced || p.querySelector("mjx-container")) return;
    var text = p.textContent;
    [["\\(", "\\)"], ["\\[", "\\]"]].forEach(function (pair) {
      var open = text.indexOf(pair[0]), close = text.indexOf(pair[1]);
      if (close >= 0 && (open < 0 || close < open)) text = "…" + text.slice(close + 2);
      open = text.lastIndexOf(pair[0]);
      close = text.lastIndexOf(pair[1]);
      if (open >= 0 && close < open) text = text.slice(0, open) + "…";
    });
    p.textContent = text;
    p.dataset.depthsatBalanced = "1";
  }
  document.addEventListener("DOMContentLoaded", function () {
    var sphinxLoadsMathJax = document.querySelector('script[src*="mathjax/tex-chtml.js"]');
    if (!sphinxLoadsMathJax && document.querySelector(".math")) typeset(document.body);
    var results = document.getElementById("search-results");
    if (!results) return;
    var pending = null;
    new MutationObserver(function () {
      if (pending) clearTimeout(pending);
      pending = setTimeout(function () {
        results.querySelectorAll("p.context").forEach(balance);
        if (/\\\(|\\\[/.test(results.textContent)) typeset(results);
      }, 300);
    }).observe(results, { childList: true, subtree: true });
  });
})();

// Display equations fit the column: on a narrow screen (a phone at 390 px) an equation wider than
// the text column is scaled down to fit, to no less than MIN_SCALE of its size; one that still does
// not fit scrolls inside its own box, with a visible scrollbar (class depthsat-math-scroll).
// MathJax 3 has no automatic line breaking, so this is what keeps "⇔ s > 0" on the screen.
(function () {
  "use strict";
  var MIN_SCALE = 0.5;
  function fit() {
    document.querySelectorAll('mjx-container[display="true"]').forEach(function (el) {
      el.style.fontSize = "";
      el.classList.remove("depthsat-math-scroll");
      var need = el.scrollWidth, have = el.clientWidth;
      if (!have || need <= have + 1) return;
      var scale = Math.max(MIN_SCALE, (have - 2) / need);
      el.style.fontSize = Math.floor(scale * 100) + "%";
      if (el.scrollWidth > el.clientWidth + 1) el.classList.add("depthsat-math-scroll");
    });
  }
  window.depthsatFitMath = fit;
  function whenTypeset() {
    var mj = window.MathJax;
    if (mj && mj.startup && mj.startup.promise) mj.startup.promise.then(fit);
    else if (document.querySelector(".math")) setTimeout(whenTypeset, 100);
  }
  document.addEventListener("DOMContentLoaded", whenTypeset);
  var pending = null;
  window.addEventListener("resize", function () {
    if (pending) clearTimeout(pending);
    pending = setTimeout(fit, 150);
  });
})();
