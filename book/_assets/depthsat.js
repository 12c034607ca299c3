// depthsat book: math typeset wherever it appears. Sphinx loads MathJax only on pages whose own body has
// math, but the sidebar (a chapter title with math) and the search results (summaries built from the
// pages' text, TeX still between \( and \)) show math on other pages too: there MathJax, served by the
// site itself, is loaded here, and search results are typeset as they arrive.
(function () {
  "use strict";
  var waiting = [];
  function typeset(el) {
    var mj = window.MathJax;
    if (mj && mj.typesetPromise) {
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
  document.addEventListener("DOMContentLoaded", function () {
    var sphinxLoadsMathJax = document.querySelector('script[src*="mathjax/tex-chtml.js"]');
    if (!sphinxLoadsMathJax && document.querySelector(".math")) typeset(document.body);
    var results = document.getElementById("search-results");
    if (!results) return;
    var pending = null;
    new MutationObserver(function () {
      if (pending) clearTimeout(pending);
      pending = setTimeout(function () {
        if (/\\\(|\\\[/.test(results.textContent)) typeset(results);
      }, 300);
    }).observe(results, { childList: true, subtree: true });
  });
})();
