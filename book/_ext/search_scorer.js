// depthsat book: the search ranks the book's chapters, theory and reference pages above the API
// reference's attributes. Sphinx inlines this file (html_search_scorer, set by depthsat_book) into
// language_data.js, before searchtools.js reads `Scorer`. A result is
// [docname, title, anchor, descr, score, filename]; an object's descr reads "Python attribute, in ...".
var Scorer = {
  score: function (result) {
    var docname = result[0], descr = result[3] || "", score = result[4];
    if (docname.indexOf("_autosummary/") !== 0) return score + 15;  // a chapter, theory or reference page
    var query = (new URLSearchParams(window.location.search).get("q") || "").trim().toLowerCase();
    var name = (result[2] || "").replace(/^#/, "").toLowerCase();
    var attribute = /^Python (attribute|property|data)\b/.test(descr);
    // an object searched for by its full name, or a function, class or module by its own name, stays on top
    if (query && (name === query || (!attribute && name.endsWith("." + query)))) return score + 30;
    return attribute ? score - 10 : score;
  },
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: { 0: 15, 1: 5, 2: -5 },
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,
};
