"""Chat prompts for the speculative-decoding benchmark: input-grounded ones (the answer copies much of a given
passage or piece of code, where prompt lookup shines) and open-ended ones (nothing to copy)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    grounded: bool  # the answer is largely a rewrite / edit of text given in the prompt
    content: str


_BIKE_PASSAGE = """\
The city council voted on Tuesday to extend the protected bike lane network by 40 kilometres over the next \
three years. The plan, which will cost an estimated 18 million euros, connects the northern suburbs to the \
central station and adds secure bicycle parking at twelve tram stops. Supporters argued that the existing \
lanes had already reduced traffic injuries by a third since 2019, and that demand for cycling had grown \
faster than the network itself. Opponents, mostly shop owners along Market Street, warned that removing \
140 parking spaces would hurt their business and asked the council to phase the work so that deliveries \
could continue during construction. The council agreed to build the Market Street section last and to \
review its impact on local shops after one year. Construction of the first section is expected to begin \
in March."""

_BEE_PASSAGE = """\
Honey bees communicate the location of food through a behaviour known as the waggle dance. When a forager \
returns to the hive after finding a good source of nectar, it walks in a straight line while shaking its \
body from side to side, then circles back and repeats the movement. The direction of the straight run, \
measured relative to the vertical comb, tells the other bees the direction of the food relative to the \
sun. The length of the run tells them the distance: the longer the waggle, the farther away the flowers \
are. Other workers follow the dancer closely, touching it with their antennae, and then leave the hive to \
search for the food themselves. Scientists first decoded this language in the 1940s, and the discovery \
later earned the researcher Karl von Frisch a share of the Nobel Prize."""

_INVENTORY_CODE = """\
def summarize(orders):
    totals = {}
    for o in orders:
        if o["status"] == "cancelled":
            continue
        customer = o["customer"]
        if customer not in totals:
            totals[customer] = 0
        totals[customer] = totals[customer] + o["price"] * o["quantity"]
    result = []
    for customer in totals:
        result.append((customer, totals[customer]))
    result.sort(key=lambda item: item[1], reverse=True)
    return result


def top_customers(orders, n):
    ranked = summarize(orders)
    names = []
    for customer, total in ranked[:n]:
        names.append(customer)
    return names"""

_JS_CODE = """\
function formatUser(user) {
  var name = user.firstName + " " + user.lastName;
  var age = user.age;
  var email = user.email;
  if (email == null) {
    email = "unknown";
  }
  var lines = [];
  lines.push("Name: " + name);
  lines.push("Age: " + age);
  lines.push("Email: " + email);
  return lines.join("\\n");
}

function formatUsers(users) {
  var out = [];
  for (var i = 0; i < users.length; i++) {
    out.push(formatUser(users[i]));
  }
  return out.join("\\n\\n");
}"""

_EMAIL = """\
Hi Sarah,

Thank you for you're email. I wanted to let you know that the meeting on thursday has been moved to \
friday at 10 am, because several people from the design team was not available. The agenda will stay \
the same: we will review the new website mockups, discuss the budget for the next quarter and decide who \
will be responsible for the customer survey. Please could you bring the printed copys of the mockups, \
as the projecter in room 4 is still broken. If friday does not work for you, let me know as soon as \
possible so we can find an other time.

Best regards,
Tom"""

_CONFIG_CODE = """\
class Config:
    def __init__(self, path):
        self.path = path
        self.values = {}

    def load(self):
        f = open(self.path)
        for line in f.readlines():
            line = line.strip()
            if line == "" or line.startswith("#"):
                continue
            key, value = line.split("=")
            self.values[key.strip()] = value.strip()
        f.close()

    def get(self, key, default=None):
        if key in self.values:
            return self.values[key]
        return default

    def get_int(self, key, default=0):
        value = self.get(key)
        if value is None:
            return default
        return int(value)"""

PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("rewrite-news", True,
                "Rewrite the following news report in plain, simple English, keeping all the facts."
                f"\n\n{_BIKE_PASSAGE}"),
    BenchPrompt("summarise-bees", True,
                f"Summarise the following passage in a few sentences.\n\n{_BEE_PASSAGE}"),
    BenchPrompt("fix-email", True,
                f"Correct the spelling and grammar mistakes in this email. Reply with the corrected email only."
                f"\n\n{_EMAIL}"),
    BenchPrompt("edit-python", True,
                "Rename the function `summarize` to `totals_by_customer` everywhere in this code. Reply with the "
                f"full code.\n\n```python\n{_INVENTORY_CODE}\n```"),
    BenchPrompt("edit-js", True,
                "Rewrite this JavaScript to use const/let instead of var and template literals instead of string "
                f"concatenation. Reply with the full code.\n\n```javascript\n{_JS_CODE}\n```"),
    BenchPrompt("refactor-config", True,
                "Change this class so that load() uses a with statement to open the file. Reply with the full "
                f"class.\n\n```python\n{_CONFIG_CODE}\n```"),
    BenchPrompt("story", False, "Write a short story about a robot who learns to paint."),
    BenchPrompt("explain-sky", False, "Why is the sky blue? Explain it to a curious ten-year-old."),
    BenchPrompt("tips-language", False, "Give me some practical tips for learning a new language as an adult."),
    BenchPrompt("poem-autumn", False, "Write a poem about an autumn evening in a small village."),
)
