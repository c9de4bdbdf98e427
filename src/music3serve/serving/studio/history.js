// The takes list: replay, reuse, download (WAV made here, other formats encoded by the server) and A/B of two takes.

import { ApiError, postSong } from "./api.js";
import { Player, clock } from "./player.js";
import { deleteTake, download, getTake, listTakes, saveTake, wavBlob } from "./takes.js";

const $ = (id) => document.getElementById(id);
const FORMATS = { wav: "WAV", flac: "FLAC", mp3: "MP3", opus: "Opus", aac: "AAC" };
const EXTENSIONS = { wav: "wav", flac: "flac", mp3: "mp3", opus: "opus", aac: "aac" };
let page = null; // {waveform, fillForm, writing, silence}: the page's side
let playing = null; // {player, take, button}: a take replayed from the history
const picked = []; // the takes chosen for A/B (ids, at most two)
let labelAB = () => {}; // brings the A/B buttons up to what plays

function title(take) {
  const text = take.caption.trim().replace(/\s+/g, " ");
  return text.length > 70 ? `${text.slice(0, 69)}…` : text;
}

/** The lyrics' first sung line (else their first tag). */
function firstLine(lyrics) {
  const lines = lyrics.split("\n").map((line) => line.trim()).filter(Boolean);
  return lines.find((line) => !line.startsWith("[")) || lines[0] || "";
}

function meta(take) {
  const parts = [`seed ${take.seed}`, `${(take.pcm.length / 2 / take.sampleRate).toFixed(1)} s`];
  if (take.timings.firstAudioMs !== null) parts.push(`first audio ${(take.timings.firstAudioMs / 1000).toFixed(2)} s`);
  if (take.state !== "done") parts.push(take.state);
  parts.push(new Date(take.created).toLocaleString());
  return parts.join(" · ");
}

export function stopPlayback() {
  if (!playing) return;
  playing.player.stop();
  if (playing.button) playing.button.textContent = "Play";
  playing = null;
  labelAB();
}

/** Play a take from `offset` seconds; the waveform follows it. Not while a song is being written (it plays). */
function play(take, button, offset = 0) {
  if (page.writing()) return false;
  page.silence();
  stopPlayback();
  const player = new Player(take.sampleRate);
  player.push(take.pcm, offset);
  playing = { player, take, button };
  if (button) button.textContent = "Stop";
  page.waveform.show(take.pcm, take.sampleRate);
  labelAB();
  const current = playing;
  player.onended = () => current === playing && stopPlayback();
  const length = clock(take.pcm.length / 2 / take.sampleRate);
  const follow = () => {
    page.waveform.setPlayed(current === playing ? player.position : 0, take.sampleRate);
    $("progress").textContent = `Take with seed ${take.seed} · playing ${clock(player.position)} / ${length}`;
    if (current === playing) requestAnimationFrame(follow);
  };
  requestAnimationFrame(follow);
  return true;
}

async function downloadTake(take, format, status) {
  const name = `music3-${take.seed}`;
  if (format === "wav") return download(wavBlob(take.pcm, take.sampleRate), `${name}.wav`);
  status.textContent = `The server is writing the ${FORMATS[format]} file (the take again, from its seed)…`;
  const request = { caption: take.caption, lyrics: take.lyrics, duration: take.duration, seed: take.seed,
                    sample_rate: take.sampleRate, format, stream: false };
  if (take.steps !== null) request.steps = take.steps;
  try {
    const response = await postSong(request);
    download(await response.blob(), `${name}.${EXTENSIONS[format]}`);
    status.textContent = `${FORMATS[format]} downloaded.`;
  } catch (error) {
    const why = error instanceof ApiError && error.status === 400 && /format/.test(error.message)
      ? `This server does not write ${FORMATS[format]} files (${error.message}). WAV is always available.`
      : `The ${FORMATS[format]} download failed: ${error.message}`;
    status.textContent = why;
  }
}

function pick(take, checked) {
  const at = picked.indexOf(take.id);
  if (checked && at < 0) picked.push(take.id);
  if (!checked && at >= 0) picked.splice(at, 1);
  while (picked.length > 2) picked.shift();
  for (const box of document.querySelectorAll("#takes [data-act=ab]")) {
    box.checked = picked.includes(box.closest("li").dataset.id);
  }
  showAB();
}

/** The A/B bar: play one take, then switch to the other at the same moment of the song. */
async function showAB() {
  $("ab").hidden = picked.length !== 2;
  if (picked.length !== 2) return;
  const [a, b] = await Promise.all(picked.map(getTake));
  $("ab-names").value = `A (seed ${a.seed}) and B (seed ${b.seed})`;
  $("ab-note").textContent = a.lyrics === b.lyrics ? "Same lyrics." : "These takes have different lyrics.";
  const side = () => (playing?.take.id === a.id ? "A" : playing?.take.id === b.id ? "B" : null);
  labelAB = () => {
    $("ab-play").textContent = side() ? "Stop" : "Play A";
    $("ab-switch").textContent = side() === "B" ? "Switch to A" : "Switch to B";
    $("ab-switch").disabled = !side();
  };
  $("ab-play").onclick = () => (side() ? stopPlayback() : play(a, null));
  $("ab-switch").onclick = () => play(side() === "A" ? b : a, null, playing.player.position);
  labelAB();
}

function renderTake(take) {
  const item = $("take-template").content.firstElementChild.cloneNode(true);
  item.dataset.id = take.id;
  item.querySelector(".take-title").textContent = title(take);
  item.querySelector(".take-meta").textContent = meta(take);
  item.querySelector(".take-lyrics").textContent = firstLine(take.lyrics);
  const status = item.querySelector(".take-status");
  const select = item.querySelector("[data-act=format]");
  for (const [value, label] of Object.entries(FORMATS)) select.append(new Option(label, value));
  select.value = take.format in FORMATS ? take.format : "wav";
  const act = (name) => item.querySelector(`[data-act=${name}]`);
  act("play").addEventListener("click", (event) => {
    if (playing?.take.id === take.id) return stopPlayback();
    status.textContent = play(take, event.currentTarget) ? "" : "A song is being written: it plays now (Stop ends it).";
  });
  act("seed").addEventListener("click", () => {
    $("seed").value = take.seed;
    $("seed").focus();
  });
  act("inputs").addEventListener("click", () => {
    page.fillForm(take);
    $("caption").focus();
  });
  act("ab").checked = picked.includes(take.id);
  act("ab").addEventListener("change", (event) => pick(take, event.target.checked));
  act("download").addEventListener("click", () => downloadTake(take, select.value, status));
  act("delete").addEventListener("click", async () => {
    if (playing?.take.id === take.id) stopPlayback();
    await deleteTake(take.id);
    pick(take, false);
    await render();
  });
  return item;
}

async function render() {
  const takes = await listTakes().catch(() => []);
  $("takes").replaceChildren(...takes.map(renderTake));
  $("history-empty").hidden = takes.length > 0;
}

export async function addTake(take) {
  try {
    await saveTake(take);
  } catch (error) {
    $("history-empty").hidden = false;
    $("history-empty").textContent = `This take could not be kept in the browser: ${error.message}`;
  }
  await render();
}

export function initHistory(hooks) {
  page = hooks;
  return render();
}
