// The page's one mutable state: presets, the last answer, timers, view choices.

export const state = {
  presets: null,
  result: null, // last valid /api/estimate answer
  seq: 0,
  timer: null,
  pending: false, // a control moved and its request has not been sent yet
  modelBase: {}, // a custom model's settings that have no control, from the last preset
  colourBy: "tp",
  ring: { step: 0, timer: null },
};
