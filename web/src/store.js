// Conversations kept in this browser (IndexedDB): {id, title, created, updated, settings, messages}.
//
// The database is opened on first use, so the monitor never needs it. A browser that cannot open it (a private
// window in some browsers, storage turned off) keeps the conversations in this page's memory instead: the chat
// works, without history, and `historyKept()` says so.
import { openDB } from "idb";

let opened = null; // Promise of the database, or of null when this browser cannot open one
const memory = new Map(); // id -> conversation, when there is no database

async function open() {
  try {
    return await openDB("strata", 1, {
      upgrade(database) {
        database.createObjectStore("conversations", { keyPath: "id" });
      },
    });
  } catch {
    return null; // `indexedDB` missing or refusing: no history
  }
}

function database() {
  opened ||= open();
  return opened;
}

export async function historyKept() {
  return (await database()) !== null;
}

export const DEFAULT_SETTINGS = { system: "", temperature: 0.7, reasoning: "medium", maxTokens: 1024, tools: "" };

export function newConversation() {
  const now = Date.now();
  return {
    id: crypto.randomUUID(),
    title: "New chat",
    created: now,
    updated: now,
    settings: { ...DEFAULT_SETTINGS },
    messages: [],
  };
}

export async function listConversations() {
  const db = await database();
  const all = db ? await db.getAll("conversations") : [...memory.values()];
  return all.sort((a, b) => b.updated - a.updated);
}

export async function saveConversation(conversation) {
  const db = await database();
  if (db) await db.put("conversations", conversation);
  else memory.set(conversation.id, conversation);
}

export async function deleteConversation(id) {
  const db = await database();
  if (db) await db.delete("conversations", id);
  else memory.delete(id);
}

export function download(name, value) {
  const blob = new Blob([JSON.stringify(value, null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}
