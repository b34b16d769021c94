// The plotly figures stored in the lessons' outputs (notebooks/store_outputs.py), drawn with the
// site's own copy of plotly.js (docs/hooks/lesson_figures.py): loaded only on a page that has one.
(function () {
  const here = document.currentScript.src;
  function draw() {
    const figures = document.querySelectorAll(".mpnb-figure");
    if (!figures.length) return;
    const plotly = document.createElement("script");
    plotly.src = new URL("plotly.min.js", here).href;
    plotly.onload = function () {
      figures.forEach(function (holder) {
        const figure = JSON.parse(holder.querySelector("script").textContent);
        const plot = document.createElement("div");
        holder.appendChild(plot);
        Plotly.newPlot(plot, figure.data, figure.layout, { displaylogo: false, responsive: true });
      });
    };
    document.head.appendChild(plotly);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw);
  else draw();
})();
