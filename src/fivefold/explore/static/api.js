// Talking to the explorer server: one JSON request, its problems as sentences.

export async function api(path, body) {
  if (body && body.problems) return { ok: false, problems: body.problems }; // found here
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    return { ok: false, problems: [`the explorer server does not answer (${err.message}); is \`fivefold explore\` still running?`] };
  }
  try {
    return await response.json();
  } catch (err) {
    return { ok: false, problems: [`the server sent an unreadable answer (HTTP ${response.status}).`] };
  }
}
