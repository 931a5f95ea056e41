"""Prompt sources written here, so no dataset has to be downloaded.

Template families (general topics x tasks, Python coding tasks, code in other
languages, math word problems and arithmetic with random numbers), requests about real
text and real code from Python's standard library (``stdlib_text``), follow-up turns,
the openers that seed the target's own user turns (``data.self_written_prompts``):
persona x request x format, so the target writes questions nobody templated, and requests for
lists of questions about a seed word whose items become user turns (``data.asked_prompts``). Families
sample without replacement from a product of lists where they can; ``data`` removes
duplicates and near-duplicates of the evaluation prompts.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # the family: "self", "asked", "general", "code", "polyglot", "math", "passage", "function", ...


GENERAL_TOPICS = [
    # science
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "volcanoes", "earthquakes",
    "the immune system", "DNA replication", "evolution by natural selection", "the periodic table",
    "chemical bonds", "the speed of light", "gravity", "quantum mechanics", "the theory of relativity",
    "the Big Bang", "the solar system", "the Moon's phases", "solar eclipses", "the greenhouse effect",
    "ocean currents", "coral reefs", "rainforests", "deserts", "glaciers", "hurricanes", "tornadoes",
    "lightning", "rainbows", "magnetism", "electric circuits", "batteries", "nuclear fusion",
    "nuclear fission", "radioactivity", "the human heart", "the human brain", "sleep", "dreams",
    "bacteria", "viruses", "vaccines", "antibiotics", "cells", "mitochondria", "enzymes", "proteins",
    "the nervous system", "the digestive system", "bees and pollination", "bird migration",
    "dinosaurs", "fossils", "the food chain", "ecosystems", "biodiversity", "genetics", "stem cells",
    "the ozone layer", "acid rain", "tides", "sound waves", "friction", "Newton's laws of motion",
    "energy conservation", "entropy", "telescopes", "Mars exploration", "the International Space Station",
    "exoplanets", "comets", "meteor showers",
    # technology and computing
    "machine learning", "neural networks", "artificial intelligence", "the internet", "cloud computing",
    "cybersecurity", "passwords", "encryption", "blockchain", "databases", "operating systems",
    "compilers", "version control with git", "open source software", "smartphones", "5G networks",
    "electric cars", "self-driving cars", "3D printing", "robots", "virtual reality", "social media",
    "search engines", "computer viruses", "recursion", "sorting algorithms", "binary numbers",
    "object-oriented programming", "functional programming", "APIs", "web browsers", "HTML and CSS",
    "Python", "JavaScript", "Linux", "data privacy", "big data", "the history of computers",
    "semiconductors", "solar panels", "wind turbines", "GPS", "drones", "video games", "email",
    "spreadsheets", "regular expressions", "unit testing", "debugging", "hash tables", "linked lists",
    "binary search", "graph algorithms", "time complexity", "memory management", "multithreading",
    "containers and Docker", "microservices", "the command line",
    # history and society
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the pyramids", "the Renaissance",
    "the Industrial Revolution", "World War I", "World War II", "the Cold War", "the printing press",
    "the Silk Road", "the Vikings", "the Great Wall of China", "the Olympic Games", "democracy",
    "the United Nations", "human rights", "the Magna Carta", "ancient Greece", "the Aztecs",
    "the Maya civilization", "the moon landing", "the invention of the telephone", "the history of money",
    "the abolition of slavery", "the women's suffrage movement", "the Middle Ages", "castles",
    "samurai", "the Ottoman Empire", "the history of medicine", "the history of writing",
    "elections", "taxes", "inflation", "the stock market", "supply and demand", "globalization",
    "trade", "banks", "credit cards", "cryptocurrency", "unemployment", "urbanization",
    "public transportation", "libraries", "museums", "immigration", "volunteering",
    # daily life, health and work
    "healthy eating", "exercise", "meditation", "stress management", "time management",
    "public speaking", "job interviews", "writing a resume", "saving money", "budgeting", "investing",
    "retirement planning", "buying a house", "renting an apartment", "cooking pasta", "baking bread",
    "making coffee", "tea", "vegetarian diets", "gardening", "houseplants", "composting", "recycling",
    "reducing plastic waste", "learning a new language", "studying for exams", "online learning",
    "remote work", "team meetings", "leadership", "negotiation", "customer service", "starting a business",
    "marketing", "friendship", "parenting", "pets", "dogs", "cats", "training a puppy", "first aid",
    "drinking enough water", "walking", "running a marathon", "yoga", "cycling", "swimming",
    "camping", "hiking", "travel on a budget", "packing for a trip", "jet lag", "moving to a new city",
    "cleaning the house", "minimalism", "procrastination", "motivation", "habits", "kindness",
    "gratitude", "happiness", "loneliness", "screen time", "reading more books", "journaling",
    # arts, culture, nature
    "jazz", "classical music", "learning the guitar", "the piano", "painting", "photography",
    "poetry", "Shakespeare", "fairy tales", "mythology", "Greek gods", "film making", "animation",
    "architecture", "fashion", "street art", "theater", "chess", "football", "basketball", "tennis",
    "the World Cup", "board games", "card games", "origami", "knitting", "pottery", "dance",
    "comic books", "science fiction", "detective stories", "libraries of the future", "the ocean",
    "mountains", "rivers", "forests", "autumn", "winter", "spring", "summer", "the night sky",
    "sunsets", "whales", "elephants", "octopuses", "wolves", "butterflies", "ants", "penguins",
    "owls", "sharks", "horses", "trees", "flowers", "mushrooms", "the weather", "seasons",
    "islands", "cities", "villages", "trains", "airplanes", "bicycles", "ships", "bridges",
    # ideas and math concepts
    "philosophy", "ethics", "free will", "logic", "critical thinking", "the scientific method",
    "probability", "statistics", "prime numbers", "fractions", "percentages", "geometry",
    "the Pythagorean theorem", "algebra", "calculus", "infinity", "zero", "pi", "the Fibonacci sequence",
    "game theory", "economics", "psychology", "memory", "creativity", "curiosity", "language",
    "translation", "emotions", "empathy", "decision making", "artificial sweeteners", "caffeine",
]

GENERAL_TASKS = [
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Give me three interesting facts about {topic}.",
    "Summarize the key ideas of {topic} in one paragraph.",
    "List five things everyone should know about {topic}.",
    "Write a short story that involves {topic}.",
    "Compare {topic} and {other}.",
    "What do {topic} and {other} have in common?",
    "What are the pros and cons of {topic}?",
    "How would you explain {topic} to a ten-year-old?",
    "Write an email to a friend about {topic}.",
    "Write the introduction of a blog post about {topic}.",
    "Give step-by-step instructions for getting started with {topic}.",
    "What are common misconceptions about {topic}?",
    "Create a quiz with three questions about {topic}, with answers.",
    "Why is {topic} important?",
    "Describe the history of {topic}.",
    "Write a tweet about {topic}.",
    "Write a limerick about {topic}.",
    "What questions should I ask an expert on {topic}?",
    "Make a one-week study plan to understand {topic}.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Summarize {topic} in one sentence.",
    "Write a persuasive paragraph about {topic}.",
    "Describe {topic} using an analogy.",
    "What are the main challenges related to {topic}?",
    "Tell me a fun fact about {topic}.",
    "Outline an essay on {topic}.",
    "Write a short speech about {topic}.",
    "What careers are related to {topic}?",
    "How does {topic} affect everyday life?",
    "Give me a brief timeline of {topic}.",
    "Write a riddle about {topic}.",
    "Define {topic} and give an example.",
    "How has {topic} changed over the last hundred years?",
    "What would the world be like without {topic}?",
    "Write a product description inspired by {topic}.",
    "Give me a list of books or resources to learn about {topic}.",
    "What is a good way to remember facts about {topic}?",
    "Write a formal letter to a newspaper about {topic}.",
]

GENERAL_STYLES = ["", " Keep it brief.", " Use bullet points.", " Write for a high school student.",
                  " Use about 100 words.", " Be specific."]

CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "compute the factorial of n",
    "find the largest element in a list", "merge two sorted lists", "count the vowels in a string",
    "remove duplicates from a list while keeping the order", "check if a string is a palindrome",
    "compute the nth Fibonacci number", "sort a list of dictionaries by a key",
    "read a CSV file and print each row", "flatten a nested list", "find the second largest number in a list",
    "convert Celsius to Fahrenheit", "compute the greatest common divisor of two numbers",
    "do a binary search in a sorted list", "count word frequencies in a text",
    "validate an email address with a regular expression", "transpose a matrix", "implement a stack class",
    "implement a queue using two stacks", "group anagrams from a list of words",
    "compute the sum of the digits of an integer", "check if two strings are anagrams",
    "generate all permutations of a list", "find the longest common prefix of a list of strings",
    "rotate a list by k positions", "implement bubble sort", "implement quicksort", "implement merge sort",
    "compute the mean, median and mode of a list", "convert a decimal number to binary",
    "parse a JSON string and print one of its fields", "find the intersection of two lists",
    "check if a year is a leap year", "capitalize the first letter of each word",
    "compute the power set of a set", "find the missing number in a list containing 1 to n",
    "count the number of lines in a file", "implement a singly linked list", "reverse a linked list",
    "detect a cycle in a linked list", "compute the depth of a binary tree",
    "do a breadth-first search on a graph", "do a depth-first search on a graph",
    "find shortest paths with Dijkstra's algorithm", "compute the edit distance between two strings",
    "find the longest increasing subsequence", "solve the two-sum problem",
    "compute a running average of a stream of numbers", "split a list into chunks of size n",
    "remove all whitespace from a string", "count the occurrences of each character in a string",
    "find the most common element in a list", "check whether parentheses are balanced",
    "evaluate a postfix expression", "convert Roman numerals to integers", "convert integers to Roman numerals",
    "find all primes up to n with the sieve of Eratosthenes", "compute the dot product of two vectors",
    "multiply two matrices", "shuffle a list", "write a list of lines to a text file",
    "sort a dictionary by its values", "invert a dictionary", "merge two dictionaries",
    "compute compound interest", "format a number with thousands separators",
    "check the strength of a password", "generate a random password", "compute the area of a circle",
    "find all factors of a number", "check if a number is a perfect square",
    "compute the least common multiple of two numbers", "find the duplicates in a list",
    "compute the cumulative sum of a list", "build a dictionary from two lists",
    "implement a simple calculator", "count the words in a sentence", "truncate a string to n characters",
    "compute the Hamming distance between two strings", "check if a list is sorted",
    "find the kth smallest element of a list", "compute a moving average",
    "group words by their first letter", "implement a binary search tree with insert and search",
    "compute the Collatz sequence of a number", "filter the even numbers from a list",
    "square every number in a list", "find the longest word in a sentence",
    "strip punctuation from a string", "reverse the order of words in a sentence",
    "count the set bits of an integer", "compute the distance between two points",
    "implement an LRU cache", "memoize a recursive function", "measure how long a function takes",
    "retry a function call when it fails", "parse command-line arguments",
    "count the unique words in a text file", "write a class for a bank account",
    "solve the Tower of Hanoi", "solve the N-Queens problem", "print Pascal's triangle",
    "check if a number is an Armstrong number", "convert hours and minutes to seconds",
    "find the median of two sorted lists", "compute the maximum subarray sum",
    "count the islands in a grid of 0s and 1s", "rotate a matrix by 90 degrees",
    "traverse a matrix in spiral order", "implement a min-heap", "merge overlapping intervals",
    "find the majority element of a list", "count the ways to climb n stairs taking 1 or 2 steps",
    "solve the 0/1 knapsack problem", "compress a string with run-length encoding",
    "implement a Caesar cipher", "check if a sentence is a pangram",
    "find the first non-repeating character in a string", "sum all numbers in a nested list",
    "generate the first n prime numbers", "compute a square root with Newton's method",
    "convert a string to snake_case", "convert snake_case to camelCase", "validate a Sudoku board",
    "find the longest palindromic substring", "count the vowels and consonants in a string",
    "find the GCD of a list of numbers", "check whether a string is a valid IPv4 address",
    "compute the day of the week for a date", "convert a string of digits to an integer without int()",
    "implement matrix addition", "find pairs in a list that sum to a target",
    "remove the vowels from a string", "compute the average word length of a sentence",
    "print a multiplication table", "simulate rolling two dice", "find the nearest number to a target in a list",
]

CODE_TEMPLATES = [
    "Write a Python function to {task}.",
    "How do I {task} in Python?",
    "Write a Python program to {task}.",
    "Show me how to {task} in JavaScript.",
    "Write a C function to {task}.",
    "Write Java code to {task}.",
    "Implement a function that can {task}. Use Python and explain the code.",
    "Write a short Python script to {task} and show an example run.",
    "What is an efficient way to {task}? Show code.",
    "Write a Python function with a docstring to {task}.",
    "Write a C++ function to {task}.",
    "Write unit tests for a function that should {task}.",
    "Explain an algorithm to {task}, then implement it in Python.",
    "Write a Rust function to {task}.",
    "I need to {task}. Can you write the code?",
]

CODE_MODIFIERS = ["", " Use type hints.", " Make it efficient.", " Add comments explaining each step.",
                  " Include a few test cases.", " Handle edge cases.", " Keep it short.",
                  " Do not use any libraries."]

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kate", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "cards", "coins", "flowers", "toy cars",
         "eggs", "oranges", "stamps", "shells", "candies"]

def _sample_product(sizes: list[int], count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """``count`` distinct index tuples from the product of ``sizes`` (all of them if fewer)."""
    total = 1
    for size in sizes:
        total *= size
    picks = rng.sample(range(total), min(count, total))
    tuples = []
    for flat in picks:
        digits = []
        for size in reversed(sizes):
            flat, digit = divmod(flat, size)
            digits.append(digit)
        tuples.append(tuple(reversed(digits)))
    return tuples


def general_prompts(count: int, rng: random.Random) -> list[Prompt]:
    sizes = [len(GENERAL_TOPICS), len(GENERAL_TASKS), len(GENERAL_STYLES)]
    prompts = []
    for topic, task, style in _sample_product(sizes, count, rng):
        # topics are listed by field, so a near neighbour makes a sensible comparison
        other = GENERAL_TOPICS[(topic + rng.randint(1, 6)) % len(GENERAL_TOPICS)]
        text = GENERAL_TASKS[task].format(topic=GENERAL_TOPICS[topic], other=other) + GENERAL_STYLES[style]
        prompts.append(Prompt(text[0].upper() + text[1:], "general"))
    return prompts


def code_prompts(count: int, rng: random.Random) -> list[Prompt]:
    sizes = [len(CODE_TASKS), len(CODE_TEMPLATES), len(CODE_MODIFIERS)]
    return [Prompt(CODE_TEMPLATES[template].format(task=CODE_TASKS[task]) + CODE_MODIFIERS[modifier], "code")
            for task, template, modifier in _sample_product(sizes, count, rng)]


def _math_problem(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 20)
    p, n = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]), rng.randint(20, 900)
    templates = [
        f"{name} has {a + c} {item}. {name} buys {b} more and gives {c} away. How many {item} are left?",
        f"A train travels at {a + 30} km/h for {c} hours. How far does it travel?",
        f"What is {a} times {b}?",
        f"Compute {a} + {b} * {c}.",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"What is {p}% of {n}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"A shirt costs ${a + 10} and is on sale for {p}% off. What is the sale price?",
        f"{name} reads {c + 5} pages a day. How many days will it take to finish a {n}-page book?",
        f"Find the average of {a}, {b}, {c} and {a + b}.",
        f"What is the least common multiple of {a} and {b}?",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"Convert {n} minutes to hours and minutes.",
        f"A recipe needs {c + 1} cups of flour for {b} cookies. How much flour is needed for {b * 3} cookies?",
        f"What is the square root of {a * a}?",
        f"Is {n} a prime number? Explain why.",
        f"Solve the system of equations: x + y = {a + b}, x - y = {a - b}.",
        f"{name} saves ${c + 4} every week. How much will {name} have saved after {b} weeks?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
        f"A car uses {c % 9 + 4} liters of fuel per 100 km. How much fuel does it need for {n} km?",
        f"What is {n} divided by {c + 1}, with remainder?",
        f"Find the derivative of {a}x^{c % 5 + 2} + {b}x.",
        f"What is the probability of rolling a sum of {c % 11 + 2} with two fair dice?",
        f"How many seconds are there in {c} hours?",
        f"A class has {a + 10} students and {p}% of them are girls. How many boys are there?",
        f"Evaluate {a}^2 - {b}^2.",
        f"Calculate the simple interest on ${n * 10} at {c % 9 + 1}% per year for {b % 10 + 1} years.",
        f"{name} is {c + 5} years old and {name}'s mother is {a % 3 + 2} times as old. "
        f"How old will the mother be in {b} years?",
        f"{name} has {a} {item} and shares them equally among {c % 6 + 2} friends. "
        f"How many does each friend get, and how many are left over?",
        f"A tank holds {n} liters and fills at {c + 2} liters per minute. How long does it take to fill?",
        f"If {c + 2} workers build a wall in {b} days, how long would {c + 4} workers take?",
        f"What is the perimeter of a square with an area of {a * a} square meters?",
        f"A bag has {a} red balls and {b} blue balls. What is the probability of drawing a red ball?",
        f"Round {n}.{a} to the nearest ten.",
        f"Write {n} in Roman numerals.",
    ]
    framing = rng.choice(["", " Show your work.", " Explain step by step.", " Give a short answer."])
    return rng.choice(templates) + framing


def math_prompts(count: int, rng: random.Random) -> list[Prompt]:
    return [Prompt(_math_problem(rng), "math") for _ in range(count)]


# ---- the target's own user turns ----------------------------------------------------------------

PERSONAS = [
    "", "", "", "I'm a nurse and", "As a small business owner,", "My 8-year-old asked me", "I'm a retired teacher.",
    "I'm a college student and", "As a software engineer,", "I'm new to programming.", "My boss wants me to",
    "I'm planning a trip and", "I'm a parent of two teenagers.", "As a beginner cook,", "I work night shifts and",
    "I'm learning English.", "I'm writing a novel and", "My grandmother", "I just moved to a new city and",
    "I'm a data analyst.", "As a freelance designer,", "I'm training for a 10k run.", "My landlord",
    "I run a small bakery.", "I'm a high school history teacher.", "I'm preparing for an exam and",
    "My friend and I had an argument about", "I have a job interview next week.", "I'm a farmer.",
    "As a manager of a small team,", "I'm a musician.", "I keep forgetting", "I'm on a tight budget.",
]
REQUEST_STARTS = [
    "What", "How", "Why", "Can you", "Could you", "Please", "I need", "Help me", "Write", "Explain", "Tell me",
    "Give me", "Is it", "Do you", "Should I", "Which", "When", "Where", "Who", "Create", "Make", "List",
    "Describe", "Compare", "Suggest", "Recommend", "Summarize", "Rewrite", "Translate", "Fix", "Plan", "Draft",
    "What's the best way to", "Is there a way to", "What are some", "How do I", "How can I", "What happens if",
    "I'm trying to", "I want to", "Can I", "Would you", "Show me", "Teach me", "Calculate", "Solve",
    "Write a poem", "Write a story", "Write an email", "Write a letter", "Is it true that", "Brainstorm",
]
# Appended to a finished self-written turn now and then: how the answer should look.
FORMATS = ["", "", "", "", "", "", " Answer in three sentences.", " Please use a list.", " Explain step by step.",
           " Include an example.", " Keep it brief.", " Go into detail.", " Use a table if it helps.",
           " Write for a beginner.", " Use plain English.", " Give pros and cons."]


def composed_prompts(texts: list[str], count: int, rng: random.Random, source: str = "composed") -> list[Prompt]:
    """``count`` prompts from requests written apart from these templates, in a random order: each as
    written once, and beyond that again with a format request (distinct texts, so they survive
    deduplication and draw other replies)."""
    order = rng.sample(texts, len(texts))
    prompts = [Prompt(text, source) for text in order[:count]]
    while len(prompts) < count:
        text = order[len(prompts) % len(order)]
        prompts.append(Prompt(text + rng.choice([f for f in FORMATS if f]), source))
    return prompts


# Starts of user turns that name a topic or a coding task (a third of the openers).
TOPIC_OPENERS = [
    "Tell me about {topic}", "I'm curious about {topic}.", "Can you help me with {topic}?",
    "I have a question about {topic}:", "Explain {topic}", "Write something about {topic}",
    "My teacher asked us about {topic}.", "What's the deal with {topic}?", "I'm writing an essay on {topic}.",
    "Quick question on {topic}:", "I want to learn about {topic}.", "How does {topic}", "Why is {topic}",
    "Give me ideas related to {topic}", "As a beginner in {topic},",
]
TASK_OPENERS = ["How do I {task}", "Write code to {task}", "I'm trying to {task}", "In Python, how can I {task}",
                "Write a program that can {task}", "What's the fastest way to {task}"]


def self_written_openers(count: int, rng: random.Random) -> list[str]:
    """Starts of user turns for the target to finish (sampled, so each is written anew):
    two thirds are persona + request start, a sixth name a topic, a sixth a coding task,
    a few are empty (a free turn)."""
    openers = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.17:
            openers.append(rng.choice(TOPIC_OPENERS).format(topic=rng.choice(GENERAL_TOPICS)))
        elif roll < 0.34:
            openers.append(rng.choice(TASK_OPENERS).format(task=rng.choice(CODE_TASKS)))
        elif roll < 0.37:
            openers.append("")
        else:
            persona, start = rng.choice(PERSONAS), rng.choice(REQUEST_STARTS)
            if persona and not persona.endswith((".", ":")) and not start.startswith(("I ", "I'")):
                start = start[0].lower() + start[1:]
            opener = f"{persona} {start}".strip()
            openers.append(opener[0].upper() + opener[1:])
    return openers


# ---- questions the target lists about a seed -----------------------------------------------------
# People ask about any of thousands of everyday things, in their own words; the templates name a few
# hundred topics. The target lists questions, opinions asked for, requests and story ideas about a seed
# (a topic above or a whole word of its vocabulary), and every item of its list becomes a user turn.
LIST_REQUESTS = [
    "Write {n} different questions people often ask about {seed}.",
    "Write {n} questions asking for someone's opinion about {seed}.",
    "Write {n} requests someone might make to an assistant about {seed}.",
    "Write {n} short creative writing requests about {seed}.",
    "Write {n} 'how do I' questions about {seed}.",
    "Write {n} questions a curious child might ask about {seed}.",
    "Write {n} questions someone might ask a friend for advice about {seed}.",
]
ITEM_NUMBER = re.compile(r"(?:^|(?<=[.?!:]))[ \t]*\d{1,2}[.)][ \t]+", re.MULTILINE)
REFERENCE_MARK = re.compile(r"\s*\[\d+\]$")


def list_requests(seeds: list[str], count: int, rng: random.Random) -> list[str]:
    return [rng.choice(LIST_REQUESTS).format(n=rng.randint(5, 10), seed=rng.choice(seeds)) + " Number them."
            for _ in range(count)]


def listed_items(text: str, min_words: int = 3, max_chars: int = 200) -> list[str]:
    """The numbered items of a list the target wrote: an item ends at its line's end or where the
    next number starts (it may write a whole list on one line); a trailing "[3]" and quotes around
    the whole item go."""
    items = []
    for piece in ITEM_NUMBER.split(text)[1:]:  # what comes before the first number is no item
        item = REFERENCE_MARK.sub("", piece.split("\n", 1)[0].strip())
        if len(item) > 2 and item[0] == item[-1] == '"':
            item = item[1:-1].strip()
        if len(item.split()) >= min_words and len(item) <= max_chars:
            items.append(item[0].upper() + item[1:])
    return items


# ---- code in other languages ---------------------------------------------------------------------

LANGUAGES = ["JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "Ruby", "PHP", "Kotlin", "Swift"]
POLYGLOT_TEMPLATES = [
    "Write a {lang} function to {task}.", "How do I {task} in {lang}?", "Show me {lang} code that can {task}.",
    "In {lang}, {task}. Explain the code.", "Write a short {lang} program to {task}.",
]
POLYGLOT_MODIFIERS = ["", "", "", " Make it efficient.", " Add comments.", " Include a usage example.",
                      " Handle edge cases.", " Keep it short."]
SQL_TABLES = [
    ("customers(id, name, city)", "orders(id, customer_id, amount, created_at)"),
    ("employees(id, name, department_id, salary, hired_on)", "departments(id, name)"),
    ("students(id, name, grade)", "enrollments(student_id, course_id, score)"),
    ("products(id, name, price, category)", "sales(id, product_id, quantity, sold_at)"),
    ("books(id, title, author_id, year)", "authors(id, name, country)"),
    ("users(id, email, signed_up_at)", "logins(user_id, logged_in_at)"),
]
SQL_TASKS = [
    "find the ten rows with the largest totals", "count rows per group and sort by the count",
    "find records that have no match in the second table", "compute a running total by date",
    "find duplicates", "show the average per group, only for groups with more than five rows",
    "find the second highest value", "list everything from the last 30 days", "join the two tables and filter",
    "rank rows within each group", "compute month-by-month totals", "delete duplicate rows keeping one",
]
SHELL_TASKS = [
    "find all files bigger than 50 MB", "rename every .txt file in a folder to .md", "count lines in all Python files",
    "show the ten largest folders", "print the most frequent IP addresses in an access log",
    "back up a folder into a dated tar.gz archive", "replace a word in every file of a folder",
    "watch a log file and print lines with ERROR", "list processes using the most memory",
    "download a list of URLs from a file", "check whether a website is up every minute",
    "delete files older than 30 days", "convert all PNG images to JPEG", "show disk usage per user",
    "split a big CSV file into smaller ones", "compare two folders and list the differences",
]
WEB_TASKS = [
    "a responsive navigation bar", "a centered login form", "a card layout with three columns", "a dark mode toggle",
    "a simple image gallery", "a sticky footer", "a button with a hover animation", "a contact form with validation",
    "a pricing table", "a progress bar",
]


def polyglot_prompts(count: int, rng: random.Random) -> list[Prompt]:
    """Code requests beyond Python: a dozen languages, SQL over small schemas, shell, HTML and CSS."""
    prompts = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.55:
            text = rng.choice(POLYGLOT_TEMPLATES).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))
        elif roll < 0.75:
            tables = " and ".join(rng.choice(SQL_TABLES))
            text = f"Given the tables {tables}, write a SQL query to {rng.choice(SQL_TASKS)}."
        elif roll < 0.9:
            text = rng.choice(["Write a bash script to {t}.", "How do I {t} from the Linux command line?",
                               "Give me a shell one-liner to {t}."]).format(t=rng.choice(SHELL_TASKS))
        else:
            text = rng.choice(["Write HTML and CSS for {t}.", "How do I make {t} with CSS?"]).format(
                t=rng.choice(WEB_TASKS))
        prompts.append(Prompt(text + rng.choice(POLYGLOT_MODIFIERS), "polyglot"))
    return prompts


# ---- requests about given text and given code -----------------------------------------------------

PASSAGE_TASKS = [
    "Summarize this in one sentence:\n\n{text}", "Summarize the following text:\n\n{text}",
    "Rewrite this paragraph in simpler words:\n\n{text}", "Explain this to a beginner:\n\n{text}",
    "Turn this into a bulleted list:\n\n{text}", "Make this shorter without losing information:\n\n{text}",
    "Translate this into French:\n\n{text}", "Translate this into Spanish:\n\n{text}",
    "Translate this into German:\n\n{text}", "Fix any grammar mistakes in this text:\n\n{text}",
    "Write a title for this text:\n\n{text}", "What are the key points of this passage?\n\n{text}",
    "Rewrite this in a more formal tone:\n\n{text}", "Rewrite this so it sounds friendlier:\n\n{text}",
    "Write two questions a reader might ask about this text, and answer them:\n\n{text}",
    "{text}\n\nWhat does this mean?", "Paraphrase the following:\n\n{text}",
    "Here is a paragraph:\n\n{text}\n\nCan you explain it in plain English?",
    "{text}\n\nRewrite the text above for a ten-year-old.", "Give this paragraph a one-line headline:\n\n{text}",
    "Proofread this:\n\n{text}", "Expand this into a longer paragraph with an example:\n\n{text}",
]
FUNCTION_TASKS = [
    "Explain what this Python function does:\n\n```python\n{code}```",
    "Add type hints to this function:\n\n```python\n{code}```",
    "Write unit tests for this function with pytest:\n\n```python\n{code}```",
    "Can this function be simplified? Show an improved version.\n\n```python\n{code}```",
    "Rewrite this Python function in JavaScript:\n\n```python\n{code}```",
    "Is there a bug in this code?\n\n{code}", "Add comments to this code:\n\n{code}",
    "{code}\nWhat does this function return? Explain step by step.",
    "Review this code and suggest improvements:\n\n```python\n{code}```",
    "Write a docstring for this function:\n\n```python\n{code}```",
]
COMPLETION_TASKS = [
    "Complete this Python function:\n\n```python\n{code}```", "{code}", "Finish the implementation:\n\n{code}",
    "Implement the function below.\n\n```python\n{code}```", "Write the body of this function:\n{code}",
]


def passage_prompts(passages: list[str], count: int, rng: random.Random, source: str = "passage") -> list[Prompt]:
    """Rewrite / summarise / translate / explain requests about given paragraphs."""
    if not passages:
        return []
    sizes = [len(passages), len(PASSAGE_TASKS)]
    return [Prompt(PASSAGE_TASKS[task].format(text=passages[text]), source)
            for text, task in _sample_product(sizes, count, rng)]


def function_prompts(functions: list, count: int, rng: random.Random) -> list[Prompt]:
    """Explain / test / port / review real functions, or complete one from its signature and docstring."""
    if not functions:
        return []
    prompts = []
    for index in rng.sample(range(len(functions)), min(count, len(functions))) * (1 + count // len(functions)):
        function = functions[index]
        if rng.random() < 0.3 and function.head != function.source:
            prompts.append(Prompt(rng.choice(COMPLETION_TASKS).format(code=function.head), "function"))
        else:
            prompts.append(Prompt(rng.choice(FUNCTION_TASKS).format(code=function.source), "function"))
        if len(prompts) == count:
            break
    return prompts


def arithmetic_prompts(count: int, rng: random.Random) -> list[Prompt]:
    """Bare arithmetic and unit questions, phrased as people type them."""
    prompts = []
    for _ in range(count):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        text = rng.choice([
            f"what is {a} * {b}", f"{a} + {b * 7} = ?", f"Calculate {a} divided by {b}.", f"What's {b}% of {a}?",
            f"Is {a} divisible by {b % 9 + 2}?", f"How much is {a} minus {b * 3}?", f"{a}/{b} as a decimal?",
            f"Convert {a} grams to kilograms.", f"How many minutes are in {b} hours?", f"What is {b} squared?",
            f"Convert {a} km to miles.", f"What is {a} in binary?", f"Round {a / b:.4f} to two decimal places.",
            f"If I earn ${a} a week, how much is that per year?", f"{b} feet in meters?",
        ])
        prompts.append(Prompt(text, "math"))
    return prompts


# ---- second turns --------------------------------------------------------------------------------

FOLLOW_UPS = [
    "Can you make that shorter?", "Thanks! Can you give me an example?", "Explain that like I'm five.",
    "Can you put that in a table?", "What about the downsides?", "Can you say more about the first point?",
    "Now write it as a bulleted list.", "Can you make it more formal?", "Is there another way to do it?",
    "Why is that?", "Could you translate that into Spanish?", "Summarize your answer in one sentence.",
    "Can you add comments to the code?", "What would you change to make it faster?", "Give me three more ideas.",
    "That's too complicated. Can you simplify it?", "Can you write a test for it?", "Are you sure? Please check.",
    "Rewrite it for a professional audience.", "What are common mistakes people make with this?",
    "Make it funnier.", "Can you continue?", "How would this work in practice?", "What should I do first?",
    "Can you explain the last part again?", "Please give me a step-by-step version.",
    "What is a good source to learn more?",
    "Can you turn that into an email?", "OK. And what if I don't have much time?", "Can you give a real-world example?",
]
