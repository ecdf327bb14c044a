// The login page's one job: keep this sign-in's key in this origin's storage (the API wants it with every
// request, next to the cookie), then leave the one-time address for the page itself.
"use strict";
(function () {
  var meta = document.querySelector('meta[name="coffer-key"]');
  if (meta && meta.content) {
    window.localStorage.setItem("coffer-key", meta.content);
  }
  window.location.replace("/");
})();
