// Conversations kept in this browser (IndexedDB): {id, title, created, updated, settings, messages}.
import { openDB } from "idb";

const db = openDB("strata", 1, {
  upgrade(database) {
    database.createObjectStore("conversations", { keyPath: "id" });
  },
});

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
  const all = await (await db).getAll("conversations");
  return all.sort((a, b) => b.updated - a.updated);
}

export async function saveConversation(conversation) {
  await (await db).put("conversations", conversation);
}

export async function deleteConversation(id) {
  await (await db).delete("conversations", id);
}

export function download(name, value) {
  const blob = new Blob([JSON.stringify(value, null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}
