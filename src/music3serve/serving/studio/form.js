// The song form: its values, errors beside their fields, the lyrics' tag warning and the examples.

const $ = (id) => document.getElementById(id);
const MAX_SEED = 2n ** 64n; // the server's range: [0, 2^64)

// A line opening with section tags keeps only the tags: text after them on that line never reaches the model
// (the checkpoint's lyrics rule, music3serve/prompt.py).
const LINE_TAGS = /^[ \t]*((?:\[[^\]]+\][ \t]*)+)(.*)$/;

const EXAMPLES = {
  song: {
    caption: "Dreamy synth-pop, 110 BPM, A minor. Breathy female vocals, close and intimate. Analog pads and " +
      "arpeggios, gated drums; the bass walks in at the chorus.",
    lyrics: "[intro]\n\n[verse]\nNeon skies over empty streets\nI keep your number on repeat\n\n" +
      "[chorus]\nHold on, hold on\nThe night is young and so are we\n\n[outro]",
  },
  instrumental: {
    caption: "Lo-fi hip hop, 82 BPM, D major. No vocals. Dusty piano chords, vinyl crackle, soft kick and " +
      "brushed snare, a warm upright bass.",
    lyrics: "[instrumental]",
  },
};

/** Lines whose text after a tag would be dropped: [{line, tags, text}] (line numbers from 1). */
export function droppedText(lyrics) {
  const out = [];
  lyrics.split("\n").forEach((line, i) => {
    const match = LINE_TAGS.exec(line);
    if (match && match[2].trim()) out.push({ line: i + 1, tags: match[1].trim(), text: match[2].trim() });
  });
  return out;
}

/** The same lyrics with each such text moved to a line of its own under its tag. */
export function splitTagLines(lyrics) {
  return lyrics
    .split("\n")
    .map((line) => {
      const match = LINE_TAGS.exec(line);
      return match && match[2].trim() ? `${match[1].trim()}\n${match[2].trim()}` : line;
    })
    .join("\n");
}

export function showLyricsWarning() {
  const box = $("lyrics-warning");
  const dropped = droppedText($("lyrics").value);
  box.hidden = dropped.length === 0;
  if (box.hidden) return;
  const shown = dropped.slice(0, 3).map((d) => `line ${d.line}: “${d.text}” after ${d.tags}`);
  if (dropped.length > 3) shown.push(`and ${dropped.length - 3} more`);
  box.replaceChildren(
    `Text after a section tag on the same line is dropped (${shown.join("; ")}). Put tags on lines of their own. `,
  );
  const fix = Object.assign(document.createElement("button"), { type: "button", className: "link",
                                                                 textContent: "Move the text to its own line" });
  fix.addEventListener("click", () => {
    $("lyrics").value = splitTagLines($("lyrics").value);
    showLyricsWarning();
    $("lyrics").focus();
  });
  box.append(fix);
}

export function useExample(name) {
  const example = EXAMPLES[name];
  if (!$("caption").value.trim() || name === "instrumental") $("caption").value = example.caption;
  $("lyrics").value = example.lyrics;
  showLyricsWarning();
  $("lyrics").focus();
}

/** Clear every error shown beside a field. */
export function clearErrors() {
  for (const node of document.querySelectorAll("#song-form .error")) {
    node.hidden = true;
    node.textContent = "";
  }
  for (const node of document.querySelectorAll("#song-form [aria-invalid]")) node.removeAttribute("aria-invalid");
}

/** Show problems [{field, text}] beside their fields ("" or an unknown field: under the form); focus the first. */
export function showErrors(problems) {
  let first = null;
  for (const { field, text } of problems) {
    const box = $(`${field}-error`) || $("form-error");
    box.textContent = box.textContent ? `${box.textContent}; ${text}` : text;
    box.hidden = false;
    const input = $(field);
    if (input) {
      input.setAttribute("aria-invalid", "true");
      const details = input.closest("details");
      if (details) details.open = true;
      first ??= input;
    }
  }
  (first || $("form-error")).focus?.();
}

/** The form's song request, or null after showing what the server could not be sent (a seed that is no integer). */
export function readRequest() {
  const seed = $("seed").value.trim();
  if (seed && (!/^\d+$/.test(seed) || BigInt(seed) >= MAX_SEED)) {
    showErrors([{ field: "seed", text: "seed must be a whole number from 0 to 2^64 - 1, or empty for a random one" }]);
    return null;
  }
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  const request = {
    caption: $("caption").value,
    lyrics: $("lyrics").value,
    duration: number("duration") ?? 30,
    sample_rate: Number($("sample_rate").value),
  };
  const steps = number("steps");
  if (steps !== null) request.steps = steps;
  if (seed) request.seed = seed.replace(/^0+(?=\d)/, ""); // digits, sent as a JSON number
  return request;
}

/** Put a take's inputs back in the form, for a new take of them: the seed goes back to random. */
export function fillForm(take) {
  $("caption").value = take.caption;
  $("lyrics").value = take.lyrics;
  $("duration").value = take.duration;
  $("steps").value = take.steps ?? "";
  $("sample_rate").value = String(take.sampleRate);
  $("format").value = take.format;
  $("seed").value = "";
  showLyricsWarning();
}
