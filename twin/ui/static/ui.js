// twin ui: the only script the pages load (the Content-Security-Policy allows no other).
// 1. A running run's page polls /runs/ID/live and swaps in the fresh summary and curves.
// 2. The runs table's checkboxes fill the compare form's a and b.
(function () {
  "use strict";

  function poll() {
    var live = document.getElementById("live");
    if (!live || !live.dataset.poll) return;
    var seconds = Number(live.dataset.pollS || "4");
    setTimeout(function () {
      fetch(live.dataset.poll, { headers: { "Accept": "text/html" } })
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          var fresh = doc.getElementById("live");
          if (fresh) live.replaceWith(document.adoptNode(fresh));
          poll();
        })
        .catch(function () { poll(); });
    }, seconds * 1000);
  }

  function picks() {
    var button = document.getElementById("compare-selected");
    if (!button) return;
    button.addEventListener("click", function (event) {
      event.preventDefault();
      var ids = Array.prototype.map.call(
        document.querySelectorAll("input.pick:checked"), function (el) { return el.value; });
      if (ids.length !== 2) {
        button.textContent = "compare (tick exactly two)";
        return;
      }
      window.location.href = "/compare?a=" + encodeURIComponent(ids[1]) + "&b=" + encodeURIComponent(ids[0]);
    });
  }

  document.addEventListener("DOMContentLoaded", function () { poll(); picks(); });
})();
