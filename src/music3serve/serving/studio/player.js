// Playback through Web Audio: streamed 16-bit stereo PCM scheduled back to back, sample-exact, and the waveform.

const LEAD_S = 0.15; // how far ahead of the clock the first piece (and any piece after a gap) is scheduled

/** Seconds as m:ss. */
/** m:ss of s seconds, to the nearest second (as the takes' "6.0 s" reads: a 5.96 s take is 0:06 long). */
export const clock = (s) => {
  const whole = Math.round(s);
  return `${Math.floor(whole / 60)}:${String(whole % 60).padStart(2, "0")}`;
};

/** Interleaved little-endian int16 stereo -> an AudioBuffer of the context. */
function toBuffer(ctx, pcm, rate) {
  const frames = pcm.length / 2;
  const buffer = ctx.createBuffer(2, frames, rate);
  const left = buffer.getChannelData(0);
  const right = buffer.getChannelData(1);
  for (let i = 0; i < frames; i++) {
    left[i] = pcm[2 * i] / 32768;
    right[i] = pcm[2 * i + 1] / 32768;
  }
  return buffer;
}

/** Plays one song: pieces pushed as they arrive play seamlessly, the context running at the song's own rate. */
export class Player {
  constructor(rate) {
    this.rate = rate;
    // The song's rate for the context: pieces then meet at exact sample boundaries, with no resampling seams.
    this.ctx = new AudioContext({ sampleRate: rate, latencyHint: "playback" });
    this.sources = new Set();
    this.startAt = null; // context time of the song's first sample
    this.nextAt = 0;
    this.scheduled = 0; // frames scheduled
    this.gaps = 0; // pieces that came after the previous one had finished playing
    this.onended = null;
    if (this.ctx.state === "suspended") this.ctx.resume(); // allowed: made in the user's click or key press
  }

  /** Queue a piece (Int16Array, interleaved stereo) right after the previous one; `offset` skips its start (s). */
  push(pcm, offset = 0) {
    if (this.ctx.state === "closed" || pcm.length === 0) return;
    const source = this.ctx.createBufferSource();
    source.buffer = toBuffer(this.ctx, pcm, this.rate);
    source.connect(this.ctx.destination);
    const now = this.ctx.currentTime;
    if (this.startAt === null) {
      this.startAt = now + LEAD_S - offset;
      this.nextAt = now + LEAD_S;
    } else if (this.nextAt < now) {
      this.gaps += 1; // the piece came late: it plays as soon as it can, and the song's clock moves with it
      this.startAt += now + LEAD_S - this.nextAt;
      this.nextAt = now + LEAD_S;
    }
    source.start(this.nextAt, offset);
    this.nextAt += source.buffer.duration - offset;
    this.scheduled += pcm.length / 2;
    this.sources.add(source);
    source.onended = () => {
      this.sources.delete(source);
      if (this.sources.size === 0 && this.onended) this.onended();
    };
  }

  /** Seconds of the song played so far. */
  get position() {
    if (this.startAt === null) return 0;
    return Math.max(0, Math.min(this.ctx.currentTime - this.startAt, this.scheduled / this.rate));
  }

  get playing() {
    return this.ctx.state === "running" && this.startAt !== null && this.ctx.currentTime >= this.startAt;
  }

  stop() {
    this.onended = null;
    for (const source of this.sources) source.stop();
    this.sources.clear();
    if (this.ctx.state !== "closed") this.ctx.close();
  }
}

/** A waveform drawn column by column as PCM arrives, with the played part and a playhead. */
export class Waveform {
  constructor(canvas) {
    this.canvas = canvas;
    this.reset(1);
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  /** Start a song of `total` frames (per channel); peaks are kept at a fixed resolution and drawn to any width. */
  reset(total) {
    this.total = Math.max(1, total);
    this.bins = 1024;
    this.peaks = new Float32Array(this.bins);
    this.filled = 0; // frames received
    this.played = 0; // seconds
    this.rate = 44100;
    this.draw();
  }

  /** Add a piece (Int16Array, interleaved stereo). */
  add(pcm) {
    const perBin = this.total / this.bins;
    for (let i = 0; i < pcm.length; i += 2) {
      const bin = Math.min(this.bins - 1, Math.floor((this.filled + i / 2) / perBin));
      const level = Math.max(Math.abs(pcm[i]), Math.abs(pcm[i + 1])) / 32768;
      if (level > this.peaks[bin]) this.peaks[bin] = level;
    }
    this.filled += pcm.length / 2;
    if (this.filled > this.total) this.total = this.filled; // the model may write past an estimate
    this.draw();
  }

  /** A whole song at once (a take from the history). */
  show(pcm, rate) {
    this.reset(pcm.length / 2);
    this.rate = rate;
    this.add(pcm);
  }

  setPlayed(seconds, rate) {
    this.played = seconds;
    this.rate = rate;
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const scale = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * scale));
    const height = Math.max(1, Math.round(canvas.clientHeight * scale));
    if (canvas.width !== width || canvas.height !== height) Object.assign(canvas, { width, height });
    const style = getComputedStyle(canvas);
    const g = canvas.getContext("2d");
    g.clearRect(0, 0, width, height);
    const mid = height / 2;
    g.fillStyle = style.getPropertyValue("--wave-track");
    g.fillRect(0, mid - scale / 2, width, scale);
    const playedX = ((this.played * this.rate) / this.total) * width;
    const perBin = this.total / this.bins;
    const used = Math.min(this.bins, Math.ceil(this.filled / perBin));
    const barWidth = Math.max(scale, width / this.bins);
    for (let bin = 0; bin < used; bin++) {
      const x = (bin / this.bins) * width;
      const h = Math.max(scale, this.peaks[bin] * (height - 4 * scale));
      g.fillStyle = style.getPropertyValue(x < playedX ? "--wave-played" : "--wave");
      g.fillRect(x, mid - h / 2, barWidth, h);
    }
    if (this.played > 0) {
      g.fillStyle = style.getPropertyValue("--wave-head");
      g.fillRect(Math.min(playedX, width - 2 * scale), 0, 2 * scale, height);
    }
  }
}
