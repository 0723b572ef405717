// Inline validation and small conveniences. Progressive: every form works without this,
// and the server's errors remain the authority.
(function () {
  "use strict";

  function messageFor(input) {
    var v = input.validity;
    if (v.valueMissing) return "This field is required.";
    if (v.patternMismatch) {
      if (input.name === "dataset_commitment") return "Enter 64 hexadecimal characters (a SHA-256 digest).";
      if (input.name === "name") return "Use lowercase letters, digits, '.', '_' or '-', starting and ending with a letter or digit.";
      if (input.name === "max_flops" || input.name === "max_tokens") return "Enter a whole number of digits (no exponent).";
      return input.title || "The value does not have the expected form.";
    }
    if (v.tooShort || v.tooLong) return "Enter " + (input.minLength > 0 ? input.minLength : input.maxLength) + " characters (now " + input.value.length + ").";
    if (v.rangeUnderflow || v.rangeOverflow || v.stepMismatch || v.badInput) return "Enter a number in the allowed range.";
    return "";
  }

  function check(input) {
    var field = input.closest(".field");
    if (!field) return true;
    var out = field.querySelector(".field-error");
    var msg = input.checkValidity() ? "" : messageFor(input);
    field.classList.toggle("has-error", msg !== "");
    if (out) out.textContent = msg;
    return msg === "";
  }

  document.querySelectorAll("form[data-inline-validate]").forEach(function (form) {
    var inputs = form.querySelectorAll("input[name], textarea[name], select[name]");
    inputs.forEach(function (input) {
      input.addEventListener("blur", function () { if (input.value !== "" || input.required) check(input); });
      input.addEventListener("input", function () {
        if (input.closest(".field") && input.closest(".field").classList.contains("has-error")) check(input);
      });
    });
    form.addEventListener("submit", function (event) {
      var ok = true, first = null;
      inputs.forEach(function (input) {
        if (input.type === "radio" || input.type === "checkbox" || input.type === "hidden") return;
        if (!check(input)) { ok = false; first = first || input; }
      });
      if (!ok) { event.preventDefault(); first.focus(); }
    });
  });

  // Behaviour the pages declare with data- attributes: no inline handlers, so the
  // Content-Security-Policy needs no 'unsafe-inline' for scripts.
  document.querySelectorAll("form[data-confirm]").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      if (!window.confirm(form.getAttribute("data-confirm"))) event.preventDefault();
    });
  });

  document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
    select.addEventListener("change", function () {
      if (select.form) select.form.submit();
    });
  });

  document.querySelectorAll("[data-select-on-focus]").forEach(function (input) {
    input.addEventListener("click", function () { input.select(); });
    input.addEventListener("focus", function () { input.select(); });
  });

  document.querySelectorAll("[data-copy]").forEach(function (button) {
    button.addEventListener("click", function () {
      var target = document.querySelector(button.getAttribute("data-copy"));
      target.select();
      if (navigator.clipboard) navigator.clipboard.writeText(target.value);
      button.textContent = "Copied";
    });
  });
})();
