// What every dashboard page does besides htmx: say why a button's request failed, keep the event feed
// free of doubles, and show whether the page's live updates are connected.
"use strict";

(() => {
  function flash(text) {
    const area = document.getElementById("flash");
    if (!area) return;
    const note = document.createElement("p");
    note.className = "error";
    note.textContent = text;
    area.replaceChildren(note);
  }

  // 400 and 409 answers are swapped in with their reason (see base.html's htmx-config); the rest land here.
  document.addEventListener("htmx:responseError", (event) => {
    const status = event.detail.xhr.status;
    flash(status === 403 ? "Your role does not allow this (HTTP 403)." : `The control plane answered HTTP ${status}.`);
  });
  document.addEventListener("htmx:sendError", () => flash("The control plane did not answer."));

  function live(connected) {
    const badge = document.getElementById("live");
    if (!badge) return;
    badge.hidden = false;
    badge.textContent = connected ? "live" : "reconnecting…";
    badge.classList.toggle("off", !connected);
  }
  // A pushed audit entry may already be on the page (rendered after its commit, pushed just after).
  document.addEventListener("htmx:wsAfterMessage", () => {
    const feed = document.getElementById("audit-feed");
    if (!feed) return;
    const seen = new Set();
    for (const item of [...feed.children]) {
      if (seen.has(item.id)) item.remove();
      else seen.add(item.id);
    }
  });

  document.addEventListener("htmx:wsOpen", () => live(true));
  document.addEventListener("htmx:wsClose", () => live(false));
})();
