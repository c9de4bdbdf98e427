// The history of takes, kept in this browser's IndexedDB: each take's inputs, seed, timings and its audio.

const DB_NAME = "music3serve-studio";
const STORE = "takes";
let opened = null;

function database() {
  opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return opened;
}

async function run(mode, work) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const request = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(request.result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

/** Keep a take: {id, created, caption, lyrics, duration, steps, seed, sampleRate, format, state, timings, pcm}. */
export const saveTake = (take) => run("readwrite", (store) => store.put(take));
export const deleteTake = (id) => run("readwrite", (store) => store.delete(id));
export const getTake = (id) => run("readonly", (store) => store.get(id));

/** Every take, newest first. */
export async function listTakes() {
  const takes = await run("readonly", (store) => store.getAll());
  return takes.sort((a, b) => b.created - a.created);
}

/** A 16-bit stereo WAV file of interleaved int16 PCM. */
export function wavBlob(pcm, rate) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, value) => [...value].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
  const bytes = pcm.length * 2;
  text(0, "RIFF");
  header.setUint32(4, 36 + bytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  header.setUint32(16, 16, true); // the fmt chunk's size
  header.setUint16(20, 1, true); // integer PCM
  header.setUint16(22, 2, true); // channels
  header.setUint32(24, rate, true);
  header.setUint32(28, rate * 4, true); // bytes per second
  header.setUint16(32, 4, true); // bytes per frame
  header.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  header.setUint32(40, bytes, true);
  return new Blob([header, pcm], { type: "audio/wav" });
}

/** Save a blob under a name through the browser's download. */
export function download(blob, name) {
  const url = URL.createObjectURL(blob);
  const link = Object.assign(document.createElement("a"), { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}
