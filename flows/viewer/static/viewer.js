// ScalingInter trajectory viewer: the few things that need a script. Every page works without it.
(function () {
  "use strict";
  // Filters apply as soon as they change.
  document.querySelectorAll("form.filters").forEach(function (form) {
    form.querySelectorAll("input[type=checkbox], select").forEach(function (el) {
      el.addEventListener("change", function () { form.submit(); });
    });
  });
  // The token view: fetched once, then shown or hidden in place (the link is the no-script fallback).
  var toggle = document.getElementById("token-toggle");
  var box = document.getElementById("tokens");
  if (toggle && box) {
    toggle.addEventListener("click", function (ev) {
      ev.preventDefault();
      if (!box.hidden) {
        box.hidden = true;
        toggle.textContent = "show tokens";
        return;
      }
      box.hidden = false;
      toggle.textContent = "hide tokens";
      if (box.dataset.loaded === "1" || box.children.length) { return; }
      box.innerHTML = '<p class="muted">decoding tokens with the run\'s tokenizer...</p>';
      fetch(toggle.dataset.src).then(function (r) { return r.text().then(function (t) { return [r.ok, t]; }); })
        .then(function (res) {
          if (res[0]) {
            box.innerHTML = res[1];
            box.dataset.loaded = "1";
          } else {
            box.innerHTML = '<p class="warn">the token view could not be built (reload to retry)</p>';
          }
        })
        .catch(function (e) { box.innerHTML = '<p class="warn">' + String(e) + "</p>"; });
    });
  }
})();
