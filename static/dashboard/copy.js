// Copy buttons: <button data-copy="#id"> copies that element's text. The Clipboard API exists only on
// secure pages (https or localhost); elsewhere the text is selected and copied the old way.
"use strict";

(() => {
  function select(element) {
    const range = document.createRange();
    range.selectNodeContents(element);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  async function copy(button) {
    const element = document.querySelector(button.dataset.copy);
    if (!element) return;
    let copied = false;
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(element.textContent);
        copied = true;
      } catch {
        copied = false;
      }
    }
    if (!copied) {
      select(element);
      copied = document.execCommand("copy");
    }
    button.textContent = copied ? "Copied" : "Selected: press Ctrl+C";
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-copy]");
    if (button) copy(button);
  });
})();
