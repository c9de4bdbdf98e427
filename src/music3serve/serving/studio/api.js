// The studio's calls to the server's native API (docs/api.md): POST, GET and DELETE /v1/songs.

const KEY_STORE = "music3serve.apiKey";
// Fields of a song request, as the server's error messages name them (a message may hold several, split by "; ").
const FIELDS = ["caption", "lyrics", "duration", "seed", "steps", "format", "sample_rate"];

export const apiKey = {
  get: () => localStorage.getItem(KEY_STORE) || "",
  set: (value) => (value ? localStorage.setItem(KEY_STORE, value) : localStorage.removeItem(KEY_STORE)),
};

function headers(json) {
  const out = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey.get();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

/** A refused request: its status, the server's message and the field it concerns ("" for the form as a whole). */
export class ApiError extends Error {
  constructor(status, message, problems, retryAfter) {
    super(message);
    this.status = status;
    this.problems = problems; // [{field, text}]
    this.retryAfter = retryAfter;
  }
}

/** Which field a part of an error message concerns: the field it starts with, or "" when none. */
export function fieldOf(text) {
  if (/^the prompt \(caption \+ lyrics\)/.test(text)) return "lyrics";
  if (/^a song of [\d.]+ s is/.test(text)) return "duration";
  const named = /^(?:body\.)?([a-z_]+)\b/.exec(text);
  return named && FIELDS.includes(named[1]) ? named[1] : "";
}

async function refusal(response) {
  let message = `${response.status} ${response.statusText}`;
  let param = "";
  try {
    const body = await response.json();
    const error = body.error ?? body.detail;
    message = typeof error === "string" ? error : error?.message || message;
    param = (typeof error === "object" && error?.param) || "";
  } catch {
    // not JSON (a proxy's page): keep the status line
  }
  const parts = param ? [message] : message.split("; ");
  const problems = parts.map((text) => ({ field: FIELDS.includes(param) ? param : fieldOf(text), text }));
  if (response.status === 401 || response.status === 403) {
    problems.forEach((p) => (p.field = "api-key"));
  }
  return new ApiError(response.status, message, problems, response.headers.get("Retry-After"));
}

/** The JSON body; the seed goes in as its digits, since a JavaScript number loses precision past 2^53. */
export function songBody(request) {
  const { seed, ...rest } = request;
  const text = JSON.stringify(rest);
  return seed ? `${text.slice(0, -1)},"seed":${seed}}` : text;
}

/** POST /v1/songs; resolves to the response once the server has accepted the song, else throws ApiError. */
export async function postSong(request) {
  const response = await fetch("/v1/songs", { method: "POST", headers: headers(true), body: songBody(request) });
  if (!response.ok) throw await refusal(response);
  return response;
}

export function cancelSong(id) {
  return fetch(`/v1/songs/${encodeURIComponent(id)}`, { method: "DELETE", headers: headers(false) });
}

/** GET /v1/songs/{id}: the song's state and progress, or null when the server does not know it. */
export async function songStatus(id) {
  const response = await fetch(`/v1/songs/${encodeURIComponent(id)}`, { headers: headers(false), cache: "no-store" });
  return response.ok ? response.json() : null;
}

/** A fresh song id: hex from the browser's random source (crypto.randomUUID needs a secure context). */
export function newSongId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return "studio-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
