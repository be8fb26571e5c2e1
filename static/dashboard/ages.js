// Relative times that tick: every <time class="age" datetime="..."> says how long ago its moment was, as the
// server's `age` filter says it (controlplane/dashboard/templatetags/age.py: seconds under a minute, then
// Django's timesince), counted here once a second rather than asked of the server. The server's clock at
// render (<meta name="server-time">) corrects for a browser whose clock is off.
"use strict";

(() => {
  // Django's timesince: the first unit that is not zero and, when not zero, the one after it.
  const UNITS = [
    ["year", 365 * 86400],
    ["month", 30 * 86400],
    ["week", 7 * 86400],
    ["day", 86400],
    ["hour", 3600],
    ["minute", 60],
  ];

  function age(seconds) {
    seconds = Math.max(0, Math.floor(seconds));
    if (seconds < 60) return seconds === 1 ? "1 second" : `${seconds} seconds`;
    const parts = [];
    for (const [name, size] of UNITS) {
      const count = Math.floor(seconds / size);
      if (count === 0) {
        if (parts.length) break;
        continue;
      }
      parts.push(`${count}\u00a0${name}${count === 1 ? "" : "s"}`);
      seconds -= count * size;
      if (parts.length === 2) break;
    }
    return parts.join(", ");
  }

  const meta = document.querySelector('meta[name="server-time"]');
  const offset = meta ? Number(meta.content) - Date.now() / 1000 : 0;

  function tick() {
    const now = Date.now() / 1000 + offset;
    for (const element of document.querySelectorAll("time.age[datetime]")) {
      const moment = Date.parse(element.getAttribute("datetime"));
      if (Number.isNaN(moment)) continue;
      const text = age(now - moment / 1000);
      if (element.textContent !== text) element.textContent = text;
    }
  }

  setInterval(tick, 1000);
})();
