// Each picture drawn by docs/figures/make_figures.py opens at full size when clicked:
// wide figures are shrunk to the text column, where their small print can be hard to read.
function linkFigures() {
  document.querySelectorAll('.md-typeset img[src*="images/"]').forEach(function (img) {
    if (img.closest("a")) return;
    var link = document.createElement("a");
    link.href = img.src;
    link.target = "_blank";
    link.title = "Open the full-size picture";
    img.parentNode.insertBefore(link, img);
    link.appendChild(img);
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(linkFigures); // Material's instant navigation: every page load
} else {
  document.addEventListener("DOMContentLoaded", linkFigures);
}
