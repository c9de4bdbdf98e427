// The studio page: a song written by the server and played while it is written, with live progress.

import { ApiError, apiKey, cancelSong, newSongId, postSong, songStatus } from "./api.js";
import { clearErrors, fillForm, readRequest, showErrors, showLyricsWarning, useExample } from "./form.js";
import { addTake, initHistory, stopPlayback } from "./history.js";
import { Player, Waveform, clock } from "./player.js";

const $ = (id) => document.getElementById(id);
const FRAME_RATE = 25; // frames per second of the model's codes
const POLL_MS = 400;
const waveform = new Waveform($("wave"));
let song = null; // the song being written: {id, player, stopped, ...}
let last = null; // the latest song, being written or written: its progress line, and its audio that plays on

// What the page measured, for people and for tests: the song's id, its state and the times (ms since the POST).
const studio = (window.studio = { state: "idle", id: null, times: {}, status: null });

// Said to screen readers at each change of state (the progress line changes too often to be read out).
const SAID = { waiting: "Sent to the server", writing: "Writing the song; it plays as it comes",
               done: "The song is done", stopped: "Stopped", failed: "The song failed", idle: "" };

function setState(state) {
  studio.state = document.body.dataset.state = state;
  $("announce").textContent = SAID[state];
  const busy = state === "waiting" || state === "writing";
  $("generate").disabled = busy;
  $("stop").disabled = !busy;
}

function banner(text) {
  $("banner").textContent = text;
  $("banner").hidden = !text;
}

const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;

/** The progress line: frames written, windows rendered, time to first audio and the real-time factor. */
function showProgress() {
  if (!last) return;
  const { status, times } = studio;
  const now = times.end ?? performance.now() - last.t0;
  const audio = last.frames / last.rate;
  const parts = [];
  const queued = studio.state === "writing" && status?.state === "queued"; // accepted, waiting for the talker's rows
  const state = { waiting: "Waiting for the server", writing: queued ? "Queued" : "Writing", done: "Done",
                  stopped: "Stopped", failed: "Failed" }[studio.state];
  parts.push(state);
  if (status) parts.push(`frames ${status.frames_written} / ${status.frame_budget}`,
                         `windows ${status.windows_rendered}`);
  if (times.firstAudio !== undefined) parts.push(`first audio ${seconds(times.firstAudio)}`);
  if (audio > 0 && now > 0) parts.push(`${(audio / (now / 1000)).toFixed(2)}× real time`);
  if (last.player.startAt !== null) parts.push(`playing ${clock(last.player.position)} / ${clock(audio)}`);
  if (last.player.gaps) parts.push(`${last.player.gaps} gaps`);
  $("progress").textContent = parts.join(" · ");
}

/** The server's progress of the song being written (frames written, windows rendered). */
async function refreshStatus() {
  const id = song?.id;
  const status = id && (await songStatus(id).catch(() => null));
  if (status && song?.id === id && !studio.times.end) studio.status = status;
  showProgress();
}

async function poll() {
  const id = song.id;
  while (song?.id === id && !studio.times.end) {
    await refreshStatus();
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

/** The playhead and the progress line, each frame, while the song is written and while its audio plays. */
function animate(current) {
  if (current !== last) return; // another song, or a take from the history, plays now
  if (current === song && current.player.playing && studio.times.playing === undefined) {
    studio.times.playing = performance.now() - current.t0;
  }
  waveform.setPlayed(current.player.position, current.rate);
  showProgress();
  if (current === song || current.player.sources.size) requestAnimationFrame(() => animate(current));
}

/** Stop the latest song's audio (it plays on after it is written). */
function silence() {
  last?.player.stop();
  last = null;
}

/** Read the streamed PCM: each piece is played, drawn and kept; a piece may end mid-sample (bytes carried over). */
async function readStream(response) {
  const reader = response.body.getReader();
  let carry = new Uint8Array(0);
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    const bytes = new Uint8Array(carry.length + value.length);
    bytes.set(carry);
    bytes.set(value, carry.length);
    const whole = bytes.length - (bytes.length % 4); // 4 bytes per stereo 16-bit frame
    carry = bytes.slice(whole);
    if (whole === 0) continue;
    const pcm = new Int16Array(bytes.buffer.slice(0, whole));
    if (studio.times.firstAudio === undefined) {
      studio.times.firstAudio = performance.now() - song.t0;
      studio.times.firstAudioAt = Date.now();
    }
    refreshStatus(); // a window has come: its count now, not at the next poll
    song.pieces.push(pcm);
    song.frames += pcm.length / 2;
    if (!song.stopped) song.player.push(pcm);
    waveform.add(pcm);
  }
}

async function generate() {
  if (song) return;
  clearErrors();
  banner("");
  const request = readRequest();
  if (!request) return;
  stopPlayback();
  silence();
  const id = newSongId();
  // Made inside the click or key press: browsers let a page start audio only from a user's gesture.
  const player = new Player(request.sample_rate);
  last = song = { id, player, stopped: false, pieces: [], frames: 0, rate: request.sample_rate, t0: performance.now() };
  Object.assign(studio, { id, times: {}, status: null });
  setState("waiting");
  waveform.reset(request.duration * request.sample_rate);
  showProgress();
  let response;
  try {
    response = await postSong({ ...request, format: "pcm", id });
  } catch (error) {
    return refused(error);
  }
  const current = song;
  current.seed = response.headers.get("X-Seed");
  $("seed-used").value = current.seed;
  $("now-seed").hidden = false;
  const budget = Number(response.headers.get("X-Frame-Budget"));
  waveform.reset((budget / FRAME_RATE) * current.rate);
  setState("writing");
  poll();
  requestAnimationFrame(() => animate(current));
  let failure = null;
  try {
    await readStream(response);
  } catch (error) {
    failure = error; // a song that fails mid-stream is cut short (docs/api.md): its status says why
  }
  studio.times.end = performance.now() - current.t0;
  const status = (await songStatus(id).catch(() => null)) ?? studio.status;
  studio.status = status;
  const stopped = current.stopped || status?.state === "cancelled";
  const state = status?.state === "done" ? "done" : stopped ? "stopped" : "failed";
  if (state === "failed") banner(`The song failed: ${status?.error || failure?.message || "the stream was cut"}`);
  await keep(current, request, state, status);
  setState(state);
  showProgress();
  current.player.onended = () => current === last && waveform.setPlayed(0, current.rate);
  song = null;
}

function refused(error) {
  const current = song;
  song = null;
  silence();
  setState("idle");
  if (!(error instanceof ApiError)) {
    banner(`Cannot reach the server: ${error.message}`);
  } else if (error.status === 429) {
    banner(`The server is busy: ${error.message}. Try again in ${error.retryAfter || "a few"} s.`);
  } else if (error.status === 503) {
    banner(`The server cannot take songs now: ${error.message}`);
  } else if (!(error.status === 409 && current.stopped)) {
    showErrors(error.problems);
  }
  $("progress").textContent = current.stopped ? "Stopped before the server started the song." : "Nothing written.";
}

/** Keep the take in the history (a stopped one too: its inputs, seed and audio so far). */
async function keep(current, request, state, status) {
  const pcm = new Int16Array(current.frames * 2);
  let at = 0;
  for (const piece of current.pieces) {
    pcm.set(piece, at);
    at += piece.length;
  }
  const take = {
    id: current.id, created: Date.now(), caption: request.caption, lyrics: request.lyrics,
    duration: request.duration, steps: request.steps ?? null, seed: current.seed, sampleRate: current.rate,
    format: $("format").value, state, frames: status?.frames ?? null, endedBy: status?.ended_by ?? null,
    timings: { firstAudioMs: studio.times.firstAudio ?? null, totalMs: studio.times.end,
               server: status?.timings ?? null },
    pcm,
  };
  await addTake(take);
}

function stop() {
  if (!song || song.stopped) return;
  song.stopped = true;
  song.player.stop();
  cancelSong(song.id);
}

function init() {
  $("api-key").value = apiKey.get();
  $("api-key").addEventListener("input", () => apiKey.set($("api-key").value.trim()));
  $("song-form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  $("stop").addEventListener("click", stop);
  $("seed-random").addEventListener("click", () => {
    $("seed").value = "";
    $("seed").focus();
  });
  $("reuse-seed").addEventListener("click", () => {
    $("seed").value = $("seed-used").value;
    $("seed").focus();
  });
  $("lyrics").addEventListener("input", showLyricsWarning);
  for (const button of document.querySelectorAll("[data-example]")) {
    button.addEventListener("click", () => useExample(button.dataset.example));
  }
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      $("song-form").requestSubmit();
    } else if (event.key === "Escape") {
      if (song) return stop();
      silence(); // the latest song, playing on after it was written
      stopPlayback(); // a take from the history
    }
  });
  initHistory({ waveform, fillForm, writing: () => song !== null, silence });
  setState("idle");
}

init();
