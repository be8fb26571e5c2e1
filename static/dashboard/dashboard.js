// What every dashboard page does besides htmx: say why a button's request failed, keep the event feed
// free of doubles, drop pushed elements the page does not show, and show whether the page's live updates
// are connected (and why not, when the server closed them for good).
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

  function live(connected, why) {
    const badge = document.getElementById("live");
    if (!badge) return;
    badge.hidden = false;
    badge.textContent = connected ? "live" : why || "reconnecting…";
    badge.classList.toggle("off", !connected);
  }

  // A push may name an element the page no longer shows: a row that left its list a moment before (an
  // instance stopped after a restart), a load report of a stopped instance. htmx would log an
  // htmx:oobErrorNoTarget for each; such an element has nothing to update, so it is left out of the
  // message. Only websocket messages (no xhr) are filtered: a button's answer is swapped as it is.
  htmx.defineExtension("live-swaps", {
    transformResponse(text, xhr) {
      if (xhr) return text;
      const message = document.createElement("template");
      message.innerHTML = text;
      let dropped = false;
      for (const element of [...message.content.children]) {
        const swap = element.getAttribute("hx-swap-oob");
        const selector = swap && swap.includes(":") ? swap.slice(swap.indexOf(":") + 1) : element.id && `#${CSS.escape(element.id)}`;
        if (selector && !document.querySelector(selector)) {
          element.remove();
          dropped = true;
        }
      }
      return dropped ? message.innerHTML : text;
    },
  });
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
  // htmx's ws extension reconnects after these codes only; after the others (the server's 44xx: logged out,
  // deactivated, a role too low, no such pipeline) the page stays as it is, and the badge says why.
  const RECONNECTING = [1006, 1011, 1012, 1013];
  document.addEventListener("htmx:wsClose", (event) => {
    const close = event.detail.event;
    if (RECONNECTING.includes(close.code) || close.code === 1001) live(false);
    else live(false, `not live: ${close.reason || `closed (${close.code})`}; reload the page`);
  });
})();
