// MathJax for pymdownx.arithmatex (generic mode): typeset \( \) and \[ \] inside .arithmatex.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};
